"""SmolLM2-135M's weights exported as Qwen2 (q/k/v bias Adds) and as Phi-3 (fused qkv_proj and
gate_up_proj products): runnx's greedy ids equal onnxruntime's on the same file, with and without
runnx's graph optimizations, and equal SmolLM2's own (the weights and the math are the same); a
decode step of each runs the native calls SmolLM2's does (the fusions' general patterns, no
architecture left to the nodes' kernels); Phi-3's fused weights are not held twice."""
from __future__ import annotations

from collections import Counter
from functools import cache

import pytest

import runnx
from runnx.generate.generator import Generator
from runnx.generate.tokenizer import Tokenizer

from generate_reference import ort_greedy

PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 16
ARCHITECTURES = ("qwen2_dir", "phi3_dir")


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_dir) -> list[list[int]]:
    return onnxruntime_ids(smollm2_dir)


@cache
def onnxruntime_ids(folder) -> list[list[int]]:
    tokenizer = Tokenizer.from_folder(folder)
    model = folder / "model.onnx"
    return [ort_greedy(model, model, tokenizer.encode(prompt), NEW_TOKENS) for prompt in PROMPTS]


def runnx_ids(folder, optimization_level: str) -> list[list[int]]:
    def load(path):
        return runnx.load(path, check_symbolic_dims=False, last_position=("logits",),
                          optimization_level=optimization_level)
    generator = Generator.from_folder(folder, load=load)
    ids = []
    for prompt in PROMPTS:
        generator.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=())
        ids.append(list(generator.generated[0]))
    return ids


@pytest.mark.parametrize("level", ["all", "disabled"])
@pytest.mark.parametrize("folder", ARCHITECTURES)
def test_greedy_ids_equal_onnxruntime_and_smollm2(folder, level, request, smollm2_ids):
    folder = request.getfixturevalue(folder)  # a fixture of conftest.py: skips (fails under CI) when not built
    assert runnx_ids(folder, level) == onnxruntime_ids(folder)
    assert onnxruntime_ids(folder) == smollm2_ids


def native_calls_of_a_step(folder) -> Counter:
    """How many times each native job runs in one decode step after a prompt (`shared_call`, or
    deferred: `run_calls`)."""
    from runnx.runtime import pool as decode_pool
    generator = Generator.from_folder(folder)
    generator.start(max_new_tokens=8, stop_token_ids=())
    generator.append_tokens(Tokenizer.from_folder(folder).encode(PROMPTS[0]))
    generator.generate_next_token()
    generator.generate_next_token()
    calls = Counter()
    shared_call, open_shared_call = decode_pool.shared_call, decode_pool.open_shared_call

    def spied(job, *arguments):
        calls[job.__name__] += 1
        return shared_call(job, *arguments)

    def spied_open(job, *arguments):
        opened = open_shared_call(job, *arguments)
        calls[job.__name__] += opened  # (not opened: the kernel posts the finished job instead)
        return opened

    def spied_deferred(deferred):
        calls.update(function.__name__ for function, _, _ in deferred)
        return run_calls(deferred)

    run_calls = decode_pool.run_calls
    decode_pool.shared_call, decode_pool.open_shared_call, decode_pool.run_calls = spied, spied_open, spied_deferred
    try:
        generator.generate_next_token()
    finally:
        decode_pool.shared_call, decode_pool.open_shared_call, decode_pool.run_calls = (shared_call, open_shared_call,
                                                                                        run_calls)
    return calls


@pytest.mark.parametrize("folder", ARCHITECTURES)
def test_a_decode_step_runs_smollm2s_native_calls(folder, request, smollm2_dir):
    folder = request.getfixturevalue(folder)
    want = native_calls_of_a_step(smollm2_dir)
    both = want["projected_gate_down_into"]  # (a deferred gated MLP's two calls in one)
    layers = (want["projected_rope_append"] + want["projected_rope_into"],
              want["projected_gate"] + want["projected_gate_into"] + both,
              want["gated_down"] + want["gated_down_into"] + both)
    assert layers == (30, 30, 30)  # SmolLM2's layers (their calls deferred in a compiled plan)
    assert native_calls_of_a_step(folder) == want


def test_fused_projections_hold_no_more_weight_bytes_than_separate_ones(phi3_dir, smollm2_dir):
    """Phi-3's qkv_proj and gate_up_proj products, cut into one product a projection, have their
    column blocks laid in the fused weights' own bytes (fusion/split_products.py): the export holds
    the bytes SmolLM2's holds, not those weights twice."""
    def held(model) -> int:
        return sum(value.nbytes for value in model.graph.constants.values() if hasattr(value, "nbytes"))

    phi3 = runnx.load(str(phi3_dir / "model.onnx"))
    assert len(phi3.graph.moved) == 2 * 30  # each layer's two fused weights
    assert held(phi3) <= held(runnx.load(str(smollm2_dir / "model.onnx"))) * 1.001
