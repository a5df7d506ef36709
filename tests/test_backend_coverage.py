"""Every op of every model in the official ONNX backend test suite has a runnx kernel at that
model's opset, and `runnx inspect` says so for the real-model cases."""
from __future__ import annotations

from pathlib import Path

import onnx
import onnx.backend.test.loader as backend_loader

from runnx.cli import main as runnx_cli
from runnx.ops import registry

DATA = Path(backend_loader.DATA_DIR)
# Ops of the suite runnx has no kernel for, with the reason; strict both ways (see the test).
UNSUPPORTED = {
    "ai.onnx.preview.training::Gradient": "needs automatic differentiation of a graph (onnx's reference fails it too)",
}


def _models():
    for case in backend_loader.load_model_tests(kind="node"):
        yield case.name, case.model
    for kind in ("simple", "pytorch-converted", "pytorch-operator"):
        for folder in sorted((DATA / kind).iterdir()):
            if (folder / "model.onnx").is_file():
                yield folder.name, onnx.load(folder / "model.onnx")
    for path in sorted((DATA / "light").glob("*.onnx")):
        yield path.stem, onnx.load(path)


def _nodes(graph):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _nodes(sub)


def _function_ops(model):
    return {(f.domain, f.name) for f in model.functions}


def test_every_backend_model_has_a_kernel_for_each_op():
    missing = {}
    count = 0
    for name, model in _models():
        count += 1
        opsets = {registry._canonical_domain(o.domain): o.version for o in model.opset_import}
        local = _function_ops(model)  # model-local functions are inlined at load
        for node in _nodes(model.graph):
            domain = registry._canonical_domain(node.domain)
            if (node.domain, node.op_type) in local:
                continue
            if registry.resolve(domain, node.op_type, opsets.get(domain, 0)) is None:
                missing.setdefault(f"{domain or 'ai.onnx'}::{node.op_type}", []).append(name)
    assert count > 2000
    unexpected = {op: cases for op, cases in missing.items() if op not in UNSUPPORTED}
    assert not unexpected, "\n".join(f"{op}: {cases[:3]}" for op, cases in sorted(unexpected.items()))
    assert set(UNSUPPORTED) <= set(missing), f"now supported, remove from UNSUPPORTED: {set(UNSUPPORTED) - set(missing)}"


def test_runnx_inspect_lists_no_unsupported_op_on_the_real_model_cases(capsys):
    paths = sorted((DATA / "light").glob("*.onnx"))
    assert len(paths) == 9
    for path in paths:
        assert runnx_cli(["inspect", str(path)]) == 0
        output = capsys.readouterr().out
        assert "unsupported ops: none" in output, (path.name, output[-500:])
