"""Feed validation before anything runs: each bad-input class raises its own error naming the
input (or output), what was given and what was expected."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import runnx


@pytest.fixture(scope="module")
def model():
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"], name="add"),
         helper.make_node("Neg", ["z"], ["n"], name="neg")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("n", TensorProto.FLOAT, ["batch", 3])])
    # check_symbolic_dims is off by default (as in onnxruntime); on, 'batch' must agree across inputs.
    return runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), check_symbolic_dims=True)


def _ones(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


def test_valid_feeds_run(model):
    np.testing.assert_array_equal(model.run({"x": _ones(2, 3), "y": _ones(2, 3)})["n"], -2 * _ones(2, 3))


@pytest.mark.parametrize("feeds, error, message", [
    ({"x": _ones(2, 3), "y": _ones(2, 3), "w": _ones(2, 3)}, runnx.UnknownInputError,
     r"'w' is not an input of the model \(inputs: x, y\)"),
    ({"x": _ones(2, 3)}, runnx.MissingInputError, r"input 'y' is needed by Add node 'add'"),
    ({"x": _ones(2, 3, dtype=np.float64), "y": _ones(2, 3)}, runnx.InputTypeError,
     r"input 'x' expects tensor\(float\) \(float32\), got an array of float64"),
    ({"x": _ones(2, 3), "y": _ones(6)}, runnx.InputShapeError, r"input 'y' expects rank 2 .* got shape \[6\]"),
    ({"x": _ones(2, 4), "y": _ones(2, 3)}, runnx.InputShapeError,
     r"input 'x' expects dimension 1 to be 3 .* got shape \[2, 4\]"),
    ({"x": _ones(2, 3), "y": _ones(5, 3)}, runnx.InputShapeError, r"input 'y' has batch=5 .* input 'x' has batch=2"),
    ({"x": "not an array", "y": _ones(2, 3)}, runnx.InputTypeError, r"input 'x' expects tensor\(float\)"),
    ({"x": object(), "y": _ones(2, 3)}, runnx.InputTypeError, r"input 'x' must be a numpy array, got object"),
])
def test_each_bad_input_raises_its_specific_error(model, feeds, error, message):
    with pytest.raises(error, match=message) as caught:
        model.run(feeds)
    assert isinstance(caught.value, runnx.InputError)



def test_a_feed_of_the_shape_checked_last_time_passes_and_any_other_is_checked_again():
    """Without symbolic dimensions to agree on, a feed shaped as the last one that passed is not
    checked again (a decode step's feeds); one of another shape is, every time."""
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["n"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("n", TensorProto.FLOAT, ["batch", 3])])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    for shape in ((2, 3), (2, 3), (2, 4), (2, 3), (2, 4), (5, 3)):
        if shape[1] == 3:
            np.testing.assert_array_equal(model.run({"x": _ones(*shape)})["n"], -_ones(*shape))
        else:
            with pytest.raises(runnx.InputShapeError, match=r"expects dimension 1 to be 3"):
                model.run({"x": _ones(*shape)})

def test_every_feed_not_handed_over_is_held_through_a_read_only_view_of_its_own(model):
    """runnx never writes a caller's array: a writeable one is held through a read-only view; so is
    a read-only one, a new view each run: what runnx remembers by identity is never found again
    for the caller's object, whose buffer may change between runs."""
    from runnx.interp.validation import bind_feeds, feed_specs
    specs = feed_specs(model.graph)
    writeable, read_only = _ones(2, 3), _ones(2, 3)
    read_only.flags.writeable = False
    bound = bind_feeds(specs, {"x": writeable, "y": runnx.Owned(read_only)})
    (x, x_owned), (y, y_owned) = bound[specs["x"].vid], bound[specs["y"].vid]
    assert x is not writeable and np.shares_memory(x, writeable) and not x.flags.writeable and not x_owned
    assert writeable.flags.writeable
    assert y is not read_only and np.shares_memory(y, read_only) and not y.flags.writeable and not y_owned
    assert bind_feeds(specs, {"y": read_only})[specs["y"].vid][0] is not y
    np.testing.assert_array_equal(model.run({"x": writeable, "y": read_only})["n"], -2 * _ones(2, 3))


def test_feeds_must_be_a_mapping(model):
    with pytest.raises(runnx.InputTypeError, match="mapping"):
        model.run([_ones(2, 3), _ones(2, 3)])


def test_unknown_output_names_the_output_and_lists_the_real_ones(model):
    with pytest.raises(runnx.UnknownOutputError, match=r"'nope' is not a value of the model \(outputs: n\)"):
        model.run({"x": _ones(2, 3), "y": _ones(2, 3)}, ["nope"])


def test_errors_keep_onnxruntime_style_builtin_bases():
    assert issubclass(runnx.UnknownInputError, KeyError)
    assert issubclass(runnx.InputTypeError, TypeError)
    assert issubclass(runnx.InputShapeError, ValueError)
    assert str(runnx.UnknownInputError("plain message")) == "plain message"


def test_non_contiguous_and_zero_size_feeds_are_accepted(model):
    wide = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = wide[:, ::2]  # non-contiguous
    assert not x.flags.c_contiguous
    before = wide.copy()
    np.testing.assert_array_equal(model.run({"x": x, "y": x.T.copy().T})["n"], -2 * x)
    np.testing.assert_array_equal(wide, before)
    out = model.run({"x": _ones(0, 3), "y": _ones(0, 3)})["n"]
    assert out.shape == (0, 3) and out.dtype == np.float32


def test_nan_and_inf_feeds_propagate(model):
    x = np.array([[np.nan, np.inf, -np.inf]], np.float32)
    out = model.run({"x": x, "y": _ones(1, 3)})["n"]
    np.testing.assert_array_equal(out, [[np.nan, -np.inf, np.inf]])
