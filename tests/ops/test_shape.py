"""Shape and layout ops: which results are views (and so share storage with their input), ONNX's
Slice clamping with negative steps, Split without sizes, Pad modes and crops, the element limit on
size-creating ops, against hand-computed expectations."""
import numpy as np
import pytest
from _single_node import run_node

from runnx.errors import ResourceLimitError, RunnxError
from runnx.ops import shape as ops

I64 = np.int64


def _ints(*values):
    return np.array(values, dtype=I64)


@pytest.mark.parametrize("make_view", [
    lambda x: ops.Reshape(x, _ints(4, 6)),
    lambda x: ops.Flatten(x, axis=2),
    lambda x: ops.Squeeze(x[None], _ints(0)),
    lambda x: ops.Unsqueeze(x, _ints(-1, 0)),
    lambda x: ops.Transpose(x, perm=(2, 0, 1)),
    lambda x: ops.Slice(x, _ints(0, 3), _ints(2, 0), _ints(0, 2), _ints(1, -2)),
    lambda x: ops.Split(x, _ints(1, 2), axis=1, output_count=2)[1],
])
def test_layout_ops_return_views_of_their_input(make_view):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    view = make_view(x)
    assert np.shares_memory(view, x)


def test_expand_materialises_instead_of_returning_a_broadcast_view():
    x = np.arange(3, dtype=np.float32)
    class _Unlimited:
        def check_elements(self, shape, what):
            pass
    expanded = ops.Expand(x, _ints(2, 1, 3), ctx=_Unlimited())
    assert expanded.shape == (2, 1, 3) and expanded.flags.writeable and not np.shares_memory(expanded, x)
    assert ops.Expand(x, _ints(1), ctx=_Unlimited()) is x  # nothing to broadcast: the input itself


def test_reshape_zero_copies_a_dimension_unless_allowzero():
    assert run_node("Reshape", [np.zeros((2, 3, 1), np.float32), _ints(0, -1)]).shape == (2, 3)
    assert run_node("Reshape", [np.zeros((0, 3), np.float32), _ints(3, 0)], allowzero=1).shape == (3, 0)
    with pytest.raises(RunnxError):
        run_node("Reshape", [np.zeros((2, 3), np.float32), _ints(-1, -1)])



def test_a_reshape_target_resolves_per_input_shape_and_its_errors_are_raised_every_time():
    target = _ints(0, 0, 6, -1)
    target.flags.writeable = False  # a kept memo result, the same array step after step
    for shape in ((1, 1, 384), (1, 3, 384), (2, 1, 12)):
        assert run_node("Reshape", [np.zeros(shape, np.float32), target]).shape == shape[:2] + (6, shape[2] // 6)
    for _ in range(2):
        with pytest.raises(RunnxError, match="copies a dimension"):
            run_node("Reshape", [np.zeros(6, np.float32), _ints(6, 0)])
        with pytest.raises(RunnxError, match="cannot reshape"):
            run_node("Reshape", [np.zeros((1, 1, 385), np.float32), target])

def test_slice_negative_steps_clamp_like_onnx_not_like_python():
    x = np.arange(10, dtype=np.float32)
    # start 20 clamps to the last element, end -20 to "before the first": every third backwards
    np.testing.assert_array_equal(run_node("Slice", [x, _ints(20), _ints(-20), _ints(0), _ints(-3)]), [9, 6, 3, 0])
    # a start before the beginning clamps to element 0 when stepping backwards (Python gives [])
    np.testing.assert_array_equal(run_node("Slice", [x, _ints(-12), _ints(-2**63), _ints(0), _ints(-1)]), [0])
    # end -1 is the last element, not "before the first"
    np.testing.assert_array_equal(run_node("Slice", [x, _ints(-1), _ints(-1), _ints(0), _ints(-1)]), [])
    m = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(run_node("Slice", [m, _ints(-1, 2), _ints(0, 2**62), _ints(1, 0), _ints(-2, 1)]),
                                  [[11, 9]])


def test_slice_before_opset_10_takes_attributes():
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(run_node("Slice", [x], starts=[2], ends=[100], opset=9), np.arange(2, 10))


def test_slice_step_zero_is_an_error():
    with pytest.raises(RunnxError, match="step"):
        run_node("Slice", [np.arange(4.0), _ints(0), _ints(4), _ints(0), _ints(0)])


def test_split_into_equal_parts_uses_the_declared_outputs_or_num_outputs():
    x = np.arange(7, dtype=np.float32)
    parts = run_node("Split", [x], outputs=4, num_outputs=4, opset=18)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6]]
    parts = run_node("Split", [np.arange(6.0)], outputs=3, opset=13)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    parts = run_node("Split", [np.arange(6.0)], outputs=2, split=[4, 2], opset=11)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(RunnxError, match="add up"):
        run_node("Split", [np.arange(6.0), _ints(4, 1)], outputs=2, opset=13)


def test_squeeze_and_unsqueeze_axes_move_from_attribute_to_input_at_13():
    x = np.zeros((1, 3, 1), dtype=np.float32)
    assert run_node("Squeeze", [x], axes=[-1], opset=11).shape == (1, 3)
    assert run_node("Squeeze", [x, _ints(0)], opset=13).shape == (3, 1)
    assert run_node("Squeeze", [x], opset=13).shape == (3,)
    assert run_node("Unsqueeze", [np.zeros((3,), np.float32)], axes=[0, -1], opset=11).shape == (1, 3, 1)
    assert run_node("Unsqueeze", [np.zeros((3, 4), np.float32), _ints(3, 0)], opset=13).shape == (1, 3, 4, 1)
    with pytest.raises(RunnxError, match="size 1"):
        run_node("Squeeze", [x, _ints(1)], opset=13)


@pytest.mark.parametrize("mode, expected", [
    ("constant", [9, 9, 1, 2, 3, 9]),
    ("reflect", [3, 2, 1, 2, 3, 2]),
    ("edge", [1, 1, 1, 2, 3, 3]),
    ("wrap", [2, 3, 1, 2, 3, 1]),
])
def test_pad_modes(mode, expected):
    x = np.array([1, 2, 3], dtype=np.float32)
    got = run_node("Pad", [x, _ints(2, 1), np.array(9, np.float32)], mode=mode, opset=19)
    np.testing.assert_array_equal(got, expected)


def test_pad_negative_amounts_crop_and_axes_select_the_padded_axes():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    got = run_node("Pad", [x, _ints(-1, 1, 0, -2), None, _ints(1, 0)], opset=18)
    # axis 1: crop one at the start, pad nothing after; axis 0: pad one before, crop two after
    np.testing.assert_array_equal(got, [[0, 0, 0], [1, 2, 3]])
    assert run_node("Pad", [x], pads=[0, 1, 0, 0], value=7.0, opset=2)[0].tolist() == [7, 0, 1, 2, 3]


@pytest.mark.parametrize("op, inputs", [
    ("Expand", [np.zeros((1,), np.float32), _ints(10**6, 10**6)]),
    ("Tile", [np.zeros((2, 2), np.float32), _ints(10**6, 10**6)]),
    ("Pad", [np.zeros((2, 2), np.float32), _ints(0, 0, 10**6, 10**6)]),
    ("ConstantOfShape", [_ints(10**6, 10**6)]),
    ("Range", [np.array(0, I64), np.array(10**12, I64), np.array(1, I64)]),
])
def test_size_creating_ops_check_the_element_limit_before_allocating(op, inputs):
    with pytest.raises(ResourceLimitError):
        run_node(op, inputs)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_inverts_space_to_depth(mode):
    x = np.arange(2 * 3 * 4 * 6, dtype=np.float32).reshape(2, 3, 4, 6)
    packed = run_node("SpaceToDepth", [x], blocksize=2, mode=mode, opset=28)
    assert packed.shape == (2, 12, 2, 3)
    np.testing.assert_array_equal(run_node("DepthToSpace", [packed], blocksize=2, mode=mode), x)


def test_depth_to_space_dcr_takes_the_block_offset_from_the_leading_channels():
    x = np.arange(8, dtype=np.float32).reshape(1, 8, 1, 1)
    # DCR: channel = (row offset * 2 + column offset) * depth + c, depth 2
    np.testing.assert_array_equal(run_node("DepthToSpace", [x], blocksize=2)[0, 0], [[0, 2], [4, 6]])
    np.testing.assert_array_equal(run_node("DepthToSpace", [x], blocksize=2, mode="CRD")[0, 0], [[0, 1], [2, 3]])


def test_center_crop_pad_keeps_the_extra_row_at_the_end():
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(run_node("CenterCropPad", [x, _ints(2)]), [1, 2])
    np.testing.assert_array_equal(run_node("CenterCropPad", [x, _ints(8)]), [0, 0, 1, 2, 3, 4, 0, 0])


def test_col2im_sums_overlapping_blocks():
    # 1x3 image, blocks of 1x2 at stride 1: two blocks, the middle pixel is covered by both
    columns = np.array([[[1, 10], [2, 20]]], dtype=np.float32)  # (N=1, C*2=2, L=2)
    got = run_node("Col2Im", [columns, _ints(1, 3), _ints(1, 2)])
    np.testing.assert_array_equal(got, [[[[1, 2 + 10, 20]]]])
    padded = run_node("Col2Im", [columns, _ints(1, 1), _ints(1, 2)], pads=[0, 1, 0, 1])
    np.testing.assert_array_equal(padded, [[[[2 + 10]]]])


def test_shape_start_end_clamp_and_size():
    x = np.zeros((2, 3, 4), np.float32)
    np.testing.assert_array_equal(run_node("Shape", [x], start=-2, end=10, opset=15), [3, 4])
    assert run_node("Size", [x]) == 24 and run_node("Size", [x]).dtype == I64


def test_tile_and_flatten():
    x = np.array([[1, 2]], dtype=np.int32)
    np.testing.assert_array_equal(run_node("Tile", [x, _ints(2, 2)]), [[1, 2, 1, 2], [1, 2, 1, 2]])
    assert run_node("Flatten", [np.zeros((2, 3, 4), np.float32)], axis=-1).shape == (6, 4)
    assert run_node("Flatten", [np.zeros((2, 3, 4), np.float32)], axis=0).shape == (1, 24)


def test_range_counts_exactly_and_computes_narrow_floats_as_the_opset_says():
    got = run_node("Range", [np.array(10, np.int32), np.array(4, np.int32), np.array(-3, np.int32)])
    assert got.tolist() == [10, 7] and got.dtype == np.int32
    start, limit, step = np.array(0.1, np.float16), np.array(2, np.float16), np.array(0.3, np.float16)
    # element 5: 5 * 0.3 rounds to float16 before adding 0.1 natively (1.6), not in float32 (1.601)
    native, stashed = (run_node("Range", [start, limit, step], opset=opset) for opset in (26, 27))
    assert native.dtype == stashed.dtype == np.float16 and len(native) == len(stashed) == 7
    assert native[5] == np.float16(1.6) and stashed[5] == np.float16(1.601)


def test_empty_axes_and_split_inputs_count_as_absent():
    x = np.zeros((1, 3, 1), dtype=np.float32)
    assert run_node("Squeeze", [x, np.zeros(0, I64)], opset=13).shape == (3,)
    parts = run_node("Split", [np.arange(4.0), np.zeros(0, I64)], outputs=2, opset=13)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3]]


def test_constant_inputs_fold_at_load_keeping_scalars_scalar_and_split_parts():
    from onnx import TensorProto, helper

    import runnx
    graph = helper.make_graph(
        [helper.make_node("Size", ["c"], ["size"]), helper.make_node("Split", ["c"], ["a", "b"], axis=0)], "g", [],
        [helper.make_value_info(n, helper.TypeProto()) for n in ("size", "a", "b")],
        [helper.make_tensor("c", TensorProto.FLOAT, [4], [1, 2, 3, 4])])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    assert model.folded == 2
    got = model.run({})
    assert got["size"].shape == () and got["a"].tolist() == [1, 2] and got["b"].tolist() == [3, 4]


def _spec_slice_indices(start, end, step, dim):
    """The ONNX specification's loop, literally: adjust, clamp, then walk from start towards end."""
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    indices, j = [], start
    while (j < end) if step > 0 else (j > end):
        indices.append(j)
        j += step
    return indices


def test_slice_matches_the_specification_loop_for_many_bounds():
    rng = np.random.default_rng(0)
    bounds = [-2**63, -9, -5, -1, 0, 1, 3, 5, 9, 2**63 - 1]
    for _ in range(400):
        dim = int(rng.integers(0, 6))
        start, end = (int(v) for v in rng.choice(bounds, 2))
        step = int(rng.choice([-3, -2, -1, 1, 2, 3]))
        x = np.arange(dim, dtype=np.int32)
        got = ops.Slice(x, _ints(start), _ints(end), _ints(0), _ints(step))
        assert got.tolist() == _spec_slice_indices(start, end, step, dim), (dim, start, end, step)


@pytest.mark.parametrize("view_node", [
    ("Reshape", ["x", "shape"], {}),
    ("Transpose", ["x"], {}),
    ("Squeeze", ["x"], {}),
    ("Slice", ["x", "zero", "big", "zero", "minus_one"], {}),
])
def test_a_view_keeps_its_base_alive_against_in_place_writes(view_node):
    """x is handed over (owned) and also returned: an in-place Add on a view of x must not write x."""
    from onnx import TensorProto, helper

    import runnx
    op, inputs, attributes = view_node
    nodes = [helper.make_node(op, inputs, ["view"], **attributes), helper.make_node("Add", ["view", "one"], ["y"]),
             helper.make_node("Identity", ["x"], ["x_out"])]
    constants = [helper.make_tensor("shape", TensorProto.INT64, [1], [4]),
                 helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
                 helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                 helper.make_tensor("big", TensorProto.INT64, [1], [-2**63]),
                 helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1])],
                              [helper.make_value_info(n, helper.TypeProto()) for n in ("y", "x_out")], constants)
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), check_inplace=False)
    got = model.run({"x": runnx.Owned(np.zeros((4, 1), np.float32))})
    np.testing.assert_array_equal(got["x_out"], np.zeros((4, 1)))
    assert (np.asarray(got["y"]) == 1).all()


def test_bitcast_reinterprets_bytes_as_a_view():
    from onnx import TensorProto
    x = np.array([1.0, -2.0], np.float32)
    got = ops.BitCast(x, to=TensorProto.INT32)
    assert got.tolist() == [0x3F800000, -0x40000000] and np.shares_memory(got, x)
    assert run_node("BitCast", [np.array([-1, 5], np.int8)], to=TensorProto.UINT8, opset=26).tolist() == [255, 5]
    with pytest.raises(RunnxError, match="widths"):
        run_node("BitCast", [x], to=TensorProto.INT64, opset=26)
    with pytest.raises(RunnxError, match="widths"):
        ops.BitCast(np.zeros(2, np.uint8), to=TensorProto.UINT4)


def test_attributes_exist_only_from_the_opset_that_introduced_them():
    from runnx.errors import InvalidModelError
    x = np.zeros((1, 4, 2, 2), np.float32)
    with pytest.raises(InvalidModelError, match="mode"):
        run_node("SpaceToDepth", [x], blocksize=2, mode="CRD", opset=21)
    with pytest.raises(InvalidModelError, match="start"):
        run_node("Shape", [x], start=1, opset=14)
    assert run_node("Shape", [x], opset=14).tolist() == [1, 4, 2, 2]
    with pytest.raises(InvalidModelError, match="allowzero"):
        run_node("Reshape", [x, np.array([4, 4], I64)], allowzero=1, opset=13)
    with pytest.raises(InvalidModelError, match="reduction"):
        run_node("ScatterND", [x.reshape(-1), np.array([[0]], I64), np.ones(1, np.float32)], reduction="add",
                 opset=15)


def test_int_values_remember_read_only_arrays_only():
    from runnx.ops._shape_util import int_tuple, int_values
    frozen = np.array([2, 0, -1])
    frozen.flags.writeable = False
    first = int_values(frozen)
    first.append(7)  # the caller's own list
    assert int_values(frozen) == [2, 0, -1]
    assert int_tuple(frozen) == (2, 0, -1) and int_tuple(frozen) is int_tuple(frozen)  # the remembered tuple
    changing = np.array([3, 4])  # writeable: read each time
    assert int_values(changing) == [3, 4] and int_tuple(changing) == (3, 4)
    changing[0] = 5
    assert int_values(changing) == [5, 4] and int_tuple(changing) == (5, 4)
    assert int_tuple(np.array([2.0, 3.0])) == (2, 3) and type(int_tuple(np.array([2.0]))[0]) is int
