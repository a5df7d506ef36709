"""Real SmolLM2-135M with 4-bit weights (onnxruntime's matmul_nbits_quantizer, block 32: every
projection a com.microsoft MatMulNBits; built by `make models`, marked real_model through its
fixture): greedy ids equal onnxruntime's on the same file."""
from __future__ import annotations

import onnx
import pytest

from runnx.generate.generator import Generator

from generate_reference import ort_greedy

PROMPTS = ("The capital of France is", "Water boils at a temperature of", "def fibonacci(n):")


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_int4_dir) -> Generator:
    return Generator.from_folder(smollm2_int4_dir)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_20_tokens_equal_onnxruntime(smollm2_int4_dir, smollm2_int4, prompt):
    model = smollm2_int4_dir / "model.onnx"
    expected = ort_greedy(model, model, smollm2_int4.tokenizer.encode(prompt), 20)
    smollm2_int4.generate(prompt, max_new_tokens=20, stop_token_ids=())
    assert smollm2_int4.generated[0] == expected


def test_every_projection_is_a_4_bit_matmul(smollm2_int4_dir):
    graph = onnx.load(smollm2_int4_dir / "model.onnx", load_external_data=False).graph
    quantized = [node for node in graph.node if node.op_type == "MatMulNBits"]
    assert len(quantized) == 30 * 7  # q, k, v, o, gate, up, down in each of the 30 layers
