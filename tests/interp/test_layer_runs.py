"""Runs of layer boundaries (`runnx/interp/fusion/layer_runs.py`): consecutive AttentionGatedMLPRopeAppend
nodes become one GatedLayersRun node whose decode steps are one native call looping over them, with
the logits of the nodes run one by one, bit for bit."""
import json
import shutil

import numpy as np
import onnx
import pytest

import runnx


def _deeper_llama(fixtures_dir, tmp_path, layers: int = 4):
    """tiny-llama with layers 2 .. layers - 1 added, each a copy of layer 1 (its weights shared)
    reading the one before: a folder DecoderStep loads."""
    model = onnx.load(fixtures_dir / "tiny-llama" / "model.onnx")
    graph = model.graph
    nodes = list(graph.node)
    own = [n for n in nodes if n.name.startswith("/model/layers.1/")]
    made = {o for n in own for o in n.output}
    last = max(i for i, n in enumerate(nodes) if n.name.startswith("/model/layers.1/"))
    added = []
    for k in range(2, layers):
        def renamed(name: str, k=k) -> str:
            if name in made:
                return name.replace("/model/layers.1/", f"/model/layers.{k}/").replace("present.1.", f"present.{k}.")
            if name == "/model/layers.0/Add_1_output_0":
                return f"/model/layers.{k - 1}/Add_1_output_0"
            return name.replace("past_key_values.1.", f"past_key_values.{k}.")

        for node in own:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = node.name.replace("/model/layers.1/", f"/model/layers.{k}/")
            copy.input[:] = [renamed(i) if i else i for i in node.input]
            copy.output[:] = [renamed(o) for o in node.output]
            added.append(copy)
        for values, prefix in ((graph.input, "past_key_values"), (graph.output, "present")):
            for info in [v for v in values if v.name.startswith(f"{prefix}.1.")]:
                copy = onnx.ValueInfoProto()
                copy.CopyFrom(info)
                copy.name = info.name.replace(f"{prefix}.1.", f"{prefix}.{k}.")
                values.append(copy)
    for node in nodes[last + 1:]:
        node.input[:] = [f"/model/layers.{layers - 1}/Add_1_output_0" if i == "/model/layers.1/Add_1_output_0" else i
                         for i in node.input]
    del graph.node[:]
    graph.node.extend(nodes[:last + 1] + added + nodes[last + 1:])
    folder = tmp_path / f"tiny-llama-{layers}"
    shutil.copytree(fixtures_dir / "tiny-llama", folder)
    onnx.save(model, folder / "model.onnx")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return folder


def _steps(folder, monkeypatch, runs: bool, capacity: int = 32) -> tuple[list, list]:
    """Every step's logits of a prompt and six decode steps, with layer runs fused or not, and the
    native calls each step made (`shared_call`'s jobs)."""
    from runnx.generate.decoder import DecoderStep
    from runnx.interp import fusion
    from runnx.runtime import pool as decode_pool

    with monkeypatch.context() as patch:
        if not runs:
            patch.setattr(fusion, "layer_runs", lambda graph: 0)
        decoder = DecoderStep.from_folder(folder, capacity=capacity)
    jobs, step_jobs = [], []
    shared_call = decode_pool.shared_call
    monkeypatch.setattr(decode_pool, "shared_call", lambda job, *a: jobs.append(job) or shared_call(job, *a))
    logits = []
    for tokens in ([3, 5, 7], [11], [2], [9], [4], [8], [1]):
        jobs.clear()
        logits.append(decoder.step(np.array([tokens])))
        step_jobs.append(list(jobs))
    monkeypatch.setattr(decode_pool, "shared_call", shared_call)
    return logits, step_jobs


@pytest.mark.parametrize("chunk", [8, 1])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_run_of_layer_boundaries_decodes_in_native_loops_with_the_nodes_bits(fixtures_dir, tmp_path, workers, chunk,
                                                                              monkeypatch):
    """Four layers: three boundaries (one layer's attention to the next one's cache growth) in a row
    become one GatedLayersRun node; from the second decode step (the first prepares each node's
    replay) a step runs the first boundary's native call, then the others in native loops of
    RUN_CHUNK (`attended_gated_mlp_rope_append_run`), and every step's logits are bitwise those of
    the boundaries run as nodes, with and without the pool's workers."""
    from runnx.ops import _decode_blocks, _decode_replay
    from runnx.runtime import pool as decode_pool

    monkeypatch.setattr(_decode_replay, "RUN_CHUNK", chunk)

    folder = _deeper_llama(fixtures_dir, tmp_path)
    model = runnx.load(folder / "model.onnx")
    assert model.fused["GatedLayersRun"] == 1
    (run,) = [n for n in model.graph.nodes if n.op_type == "GatedLayersRun"]
    assert run.attrs["members"] == 3 and not any(n.op_type == "AttentionGatedMLPRopeAppend" for n in model.graph.nodes)
    try:
        decode_pool.set_workers(workers)
        fused, fused_jobs = _steps(folder, monkeypatch, True)
        apart, apart_jobs = _steps(folder, monkeypatch, False)
    finally:
        decode_pool.set_workers(None)
    assert all(np.array_equal(a, b) for a, b in zip(fused, apart))
    looped = [jobs.count(_decode_blocks.attended_gated_mlp_rope_append_run) for jobs in fused_jobs]
    assert looped == [0, 0] + [-(-2 // chunk)] * 5  # the two boundaries after the first, in loops of `chunk`
    assert [jobs.count(_decode_blocks.attended_gated_mlp_rope_append) for jobs in apart_jobs] == [0] + [3] * 6
    assert [jobs.count(_decode_blocks.attended_gated_mlp_rope_append) for jobs in fused_jobs] == [0, 3] + [1] * 5


def test_a_run_whose_caches_are_not_handed_over_runs_its_nodes_with_their_bits(fixtures_dir, tmp_path, monkeypatch):
    """Caches the caller keeps (not handed over: nothing may grow them in place): no step loops
    natively; each node grows copies as Concat does, and the outputs are still the nodes'."""
    from runnx.interp import fusion
    from runnx.ops import _decode_blocks
    from runnx.runtime import pool as decode_pool

    path = _deeper_llama(fixtures_dir, tmp_path) / "model.onnx"
    fused = runnx.load(path)
    with monkeypatch.context() as patch:
        patch.setattr(fusion, "layer_runs", lambda graph: 0)
        apart = runnx.load(path)
    assert fused.fused["GatedLayersRun"] == 1 and "GatedLayersRun" not in apart.fused
    jobs = []
    shared_call = decode_pool.shared_call
    monkeypatch.setattr(decode_pool, "shared_call", lambda job, *a: jobs.append(job) or shared_call(job, *a))
    past = {n: np.zeros((1, 2, 0, 16), np.float32) for n in fused.input_names if "past" in n}
    for tokens in ([3, 5, 7], [11], [2], [9]):
        done = sum(p.shape[2] for p in list(past.values())[:1])
        feeds = {"input_ids": np.array([tokens]), "attention_mask": np.ones((1, done + len(tokens)), np.int64),
                 "position_ids": np.arange(done, done + len(tokens))[None], **past}
        got, want = fused.run(feeds), apart.run(feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
        past = {n: got[n.replace("past_key_values", "present")] for n in past}
    assert _decode_blocks.attended_gated_mlp_rope_append_run not in jobs


def test_a_grown_caches_stand_in_has_the_shape_concat_gives_it():
    """GrownCacheShape (for the shape memos of the caches a run grows inside itself): the cache's
    shape grown along axis 2 by the query's positions, of the cache's dtype, on one element."""
    from runnx.errors import RunnxError
    from runnx.ops.decoder_layers import GrownCacheShape

    past, query = np.zeros((1, 2, 6, 16), np.float32), np.zeros((1, 4, 3, 16), np.float32)
    grown = GrownCacheShape(past, query)
    assert grown.shape == np.concatenate([past, np.zeros((1, 2, 3, 16), np.float32)], axis=2).shape
    assert grown.dtype == past.dtype and grown.strides == (0, 0, 0, 0)
    with pytest.raises(RunnxError, match="4-d"):
        GrownCacheShape(past[0], query)
