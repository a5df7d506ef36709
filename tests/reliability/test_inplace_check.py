"""The checking mode over the committed fixture models (and the fuzz seeds): every in-place step is
recomputed out of place and compared — zero mismatches — and the results equal copy mode bitwise,
with caller arrays untouched."""
import numpy as np
import pytest
from onnx import helper

import runnx
from corpus import FIXTURES, F, bits, const, make_model, seed_models
from runnx.cli import generated_input

FIXTURE_MODELS = sorted(p for p in FIXTURES.rglob("*.onnx") if p.stat().st_size < 32 * 2**20) \
    if FIXTURES.is_dir() else []
MODELS = [*(pytest.param(p, id=str(p.relative_to(FIXTURES))) for p in FIXTURE_MODELS),
          *(pytest.param(m, id=f"seed-{name}") for name, m in seed_models().items())]
DIMS = {"batch_size": 1, "sequence_length": 3, "past_sequence_length": 2, "encoder_sequence_length": 4}


def _feeds(model):
    rng = np.random.default_rng(0)
    return {info.name: generated_input(info, DIMS, rng)[0] for info in model.inputs}


def _fresh(feeds, owned):
    return {n: runnx.Owned(v.copy()) if owned and isinstance(v, np.ndarray) else v for n, v in feeds.items()}


# Every model with borrowed and with owned inputs, but the slowest fixture (3000 frames): borrowed only.
CASES = [pytest.param(*model.values, owned, id=f"{'owned' if owned else 'borrowed'}-{model.id}")
         for model in MODELS for owned in (False, True)
         if not (owned and str(model.values[0]).endswith("encoder_model.onnx"))]


@pytest.mark.parametrize("source,owned", CASES)
def test_checking_mode_finds_no_mismatch_and_copy_mode_agrees(source, owned, monkeypatch):
    monkeypatch.setenv("RUNNX_CHECK_INPLACE", "1")
    checked = runnx.load(source)
    assert checked.options.check_inplace
    feeds = _feeds(checked)
    snapshot = {n: bits(v) for n, v in feeds.items()}
    result = checked.run(_fresh(feeds, owned))
    copied = runnx.load(source, inplace=False).run(_fresh(feeds, owned))
    assert {n: bits(v) for n, v in feeds.items()} == snapshot
    assert {n: bits(v) for n, v in result.items()} == {n: bits(v) for n, v in copied.items()}


def test_in_place_writes_keep_the_layout_copy_mode_would_produce():
    """Add into a transposed owned value: a layout-sensitive reduction after it must not see a
    different memory order in place than in copy mode (float32 sums would round differently)."""
    node = helper.make_node
    model = make_model([node("Neg", ["x"], ["n"]), node("Transpose", ["n"], ["t"], perm=[0, 2, 1]),
                        node("Add", ["t", "b"], ["s"]), node("ReduceSum", ["s", "axes"], ["y"], keepdims=0)],
                       [("x", F, [4, 1000, 8]), ("b", F, [4, 8, 1000])], [("y", F, None)], [const("axes", [-1])])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 1000, 8)).astype(np.float32),
             "b": rng.standard_normal((4, 8, 1000)).astype(np.float32)}
    fast, profile = runnx.load(model).run(feeds, profile=True)
    assert profile.inplace["Add"] == 0  # t is a transposed view of an owned value: not written into
    assert fast["y"].tobytes() == runnx.load(model, inplace=False).run(feeds)["y"].tobytes()
