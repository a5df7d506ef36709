"""The `runnx` command: run and inspect on the committed fixtures and on small handmade models,
error reporting (one line, exit code 2), and the subcommand plug-in contract."""
from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from runnx import cli


def make_model(path, nodes, inputs, outputs, initializers=(), opsets=(("", 18),)):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, v) for domain, v in opsets])
    onnx.save(model, str(path))
    return path


@pytest.fixture
def affine_model(tmp_path):
    """y = x @ w + b with x float[batch, 3] and an int64 token input that only feeds an output."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], np.arange(6, dtype=np.float32).tolist())
    return make_model(
        tmp_path / "affine.onnx",
        [helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
         helper.make_node("Add", ["xw", "b"], ["y"], name="add"),
         helper.make_node("Identity", ["input_ids"], ["ids_out"], name="ids")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2]),
         helper.make_tensor_value_info("ids_out", TensorProto.INT64, ["batch", "sequence_length"])],
        [weight])


@pytest.fixture
def unsupported_model(tmp_path):
    return make_model(
        tmp_path / "custom.onnx",
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Frobnicate", ["r"], ["y"], domain="com.example")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], opsets=(("", 18), ("com.example", 1)))


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------------------------- run

def test_run_generates_missing_inputs_and_saves_outputs(capsys, tmp_path, affine_model):
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, err = run_cli(capsys, "run", affine_model, "-i", f"x={tmp_path / 'x.npy'}", "--dim",
                             "sequence_length=5", "--save", tmp_path / "out.npz")
    assert code == 0, err
    assert "note: generated input b float32[2] (random normal, seed 0)" in out
    assert "note: generated input input_ids int64[2, 5] (zeros)" in out  # batch taken from x
    assert "note: generated input x" not in out
    saved = np.load(tmp_path / "out.npz")
    b = np.random.default_rng(0).standard_normal((2,)).astype(np.float32)
    np.testing.assert_allclose(saved["y"], x @ np.arange(6, dtype=np.float32).reshape(3, 2) + b, rtol=1e-6)
    assert saved["ids_out"].shape == (2, 5) and not saved["ids_out"].any()
    assert "float32[2, 2]" in out and "min " in out and "mean " in out
    assert "time: " in out


def test_run_feeds_npz_and_safetensors_by_name(capsys, tmp_path, affine_model):
    from safetensors.numpy import save_file
    x, b = np.ones((1, 3), np.float32), np.full(2, 10, np.float32)
    np.savez(tmp_path / "feeds.npz", x=x, b=b)
    save_file({"input_ids": np.arange(4, dtype=np.int64).reshape(1, 4)}, str(tmp_path / "ids.safetensors"))
    code, out, err = run_cli(capsys, "run", affine_model, "-i", tmp_path / "feeds.npz", "-i",
                             f"input_ids={tmp_path / 'ids.safetensors'}", "--save", tmp_path / "out.npz")
    assert code == 0, err
    assert "note:" not in out
    saved = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(saved["y"], [[16, 19]])
    np.testing.assert_array_equal(saved["ids_out"], [[0, 1, 2, 3]])


def test_run_iterations_profile_and_selected_output(capsys, affine_model):
    code, out, err = run_cli(capsys, "run", affine_model, "-n", "3", "--profile", "--output", "xw")
    assert code == 0, err
    assert "time per iteration: mean" in out and "(3 iterations)" in out
    assert "runnx profile: 3 run(s)" in out
    assert "MatMul" in out
    assert "  xw  " in out and "ids_out" not in out  # an intermediate value, and only it


def test_run_tiny_llama_fixture(capsys, fixtures_dir, tmp_path):
    model = fixtures_dir / "tiny-llama" / "model.onnx"
    code, out, err = run_cli(capsys, "run", model, "--dim", "sequence_length=3", "--dim", "past_sequence_length=0",
                             "--save", tmp_path / "out.npz")
    assert code == 0, err
    assert "note: generated input attention_mask int64[1, 3] (ones)" in out  # past + sequence, evaluated
    saved = np.load(tmp_path / "out.npz")
    assert saved["logits"].shape == (1, 3, 1000)
    assert saved["present.0.key"].shape == (1, 2, 3, 16)  # 2 kv heads (GQA)
    assert np.isfinite(saved["logits"]).all()


@pytest.mark.parametrize(("dim", "expected"), [
    (7, 7), (None, 1), ("batch", 4), ("unknown_symbol", 1), ("past_sequence_length + sequence_length", 5),
    ("2 * sequence_length - 1", 5), ("Addpresent.0.key_dim_3", 1)])
def test_dimension_values(dim, expected):
    assert cli.dim_value(dim, {"batch": 4, "sequence_length": 3, "past_sequence_length": 2}) == expected


# ---------------------------------------------------------------------------------------------- errors

def test_runnx_errors_are_one_line_with_exit_code_2(capsys, tmp_path, affine_model, unsupported_model):
    np.save(tmp_path / "x.npy", np.ones((1, 3), np.float64))
    cases = [
        (["run", tmp_path / "missing.onnx"], "model file not found"),
        (["run", unsupported_model], "com.example::Frobnicate"),
        (["run", affine_model, "-i", f"x={tmp_path / 'x.npy'}"], "got an array of float64"),
        (["run", affine_model, "-i", f"nope={tmp_path / 'x.npy'}"], "'nope' is not an input of the model"),
        (["run", affine_model, "-i", "x"], "input file not found"),
        (["run", affine_model, "--dim", "batch=two"], "'two' is not an integer"),
        (["inspect", tmp_path / "missing.onnx"], "model file not found"),
    ]
    for argv, expected in cases:
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, (argv, out, err)
        assert err.startswith("runnx: error: ") and expected in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err


def test_console_entry_point_reports_errors_cleanly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "runnx.cli", "inspect", str(tmp_path / "nothing.onnx")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"runnx: error: model file not found: {tmp_path / 'nothing.onnx'}\n"


# ---------------------------------------------------------------------------------------------- inspect

def test_inspect_tiny_llama(capsys, fixtures_dir):
    code, out, err = run_cli(capsys, "inspect", fixtures_dir / "tiny-llama" / "model.onnx")
    assert code == 0, err
    assert "opsets: ai.onnx 18" in out
    assert "  input_ids: int64[batch_size, sequence_length]" in out
    assert "  past_key_values.0.key: float[batch_size, 2, past_sequence_length, 16]" in out
    assert "  logits: float[batch_size, sequence_length, 1000]" in out
    # 2 layers of 64 hidden: embeddings and lm_head (1000 x 64 each) dominate
    parameters = int(out.split("parameters: ")[1].split(" ")[0].replace(",", ""))
    assert 128_000 < parameters < 300_000
    assert "  MatMul " in out


def test_inspect_counts_subgraph_nodes(capsys, fixtures_dir):
    code, out, err = run_cli(capsys, "inspect", fixtures_dir / "tiny-llama-merged" / "decoder_model_merged.onnx")
    assert code == 0, err
    assert "  use_cache_branch: bool[1]" in out
    line = next(line for line in out.splitlines() if line.startswith("nodes: "))
    main_graph, everything = int(line.split()[1]), int(line.split(", ")[1].split()[0])
    assert main_graph < 10 < everything  # the If's two branches hold the decoder
    assert any(line.split() == ["If", "1"] for line in out.splitlines())


def test_inspect_lists_unsupported_ops_without_loading(capsys, unsupported_model):
    code, out, err = run_cli(capsys, "inspect", unsupported_model)
    assert code == 0, err
    assert "unsupported ops (1):" in out
    assert "com.example::Frobnicate at opset 1: 1 node(s); runnx has no kernel" in out
    assert "Relu" in out and "Relu at" not in out


def test_inspect_plan_is_execution_order(capsys, affine_model):
    code, out, err = run_cli(capsys, "inspect", affine_model, "--plan")
    assert code == 0, err
    plan = out.split("plan (")[1].splitlines()
    assert plan[0].startswith("3 nodes")
    order = [line.split()[1] for line in plan[1:]]
    assert order.index("MatMul") < order.index("Add") and sorted(order) == ["Add", "Identity", "MatMul"]
    assert "matmul: (x, w) -> (xw)" in out


# ---------------------------------------------------------------------------------------------- plug-ins

def test_plugins_add_subcommands_and_absent_ones_are_skipped(capsys, monkeypatch):
    plugin = types.ModuleType("fake_runnx_plugin")

    def register(subparsers):
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("name")
        parser.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)

    plugin.register = register
    monkeypatch.setitem(sys.modules, "fake_runnx_plugin", plugin)
    monkeypatch.setattr(cli, "PLUGINS", ("runnx.no_such_module.cli", "fake_runnx_plugin"))
    code, out, _ = run_cli(capsys, "hello", "world")
    assert (code, out) == (3, "hello world\n")


def test_inspect_real_smollm2(capsys, smollm2_dir):
    code, out, err = run_cli(capsys, "inspect", smollm2_dir / "model.onnx")
    assert code == 0, err
    assert "parameters: 134,515,008 in 272 initializers" in out  # SmolLM2-135M, tied embeddings
    assert "  logits: float[batch_size, sequence_length, 49152]" in out
    assert "  past_key_values.29.value: float[batch_size, 3, past_sequence_length, 64]" in out
    assert "unsupported ops: none" in out
