"""The differential harness: the same model and feeds run with every optimization on ("all") and
off ("disabled": plain interpretation), compared; and a generator of decoder-like graphs whose
every block is a fusion pattern, with random shapes and constants.

Comparison: bitwise for everything but floats, and for floats within TOLERANCE. A fused kernel
may sum in another order than the nodes it replaces (a norm's mean, attention's softmax and
products, BLAS blocking for one row against many), so float32 results may differ by a few units
in the last place, amplified by the layers after; integers, booleans, shapes, NaN/inf positions
and dtypes must be identical. A model quantizing values it computes (DynamicQuantizeLinear, ...)
is compared bitwise: a unit in the last place there moves a quantized value a whole step now and
then, so runnx fuses only kernels bitwise their nodes in such a graph (interp/fusion/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import runnx

TOLERANCE = {"rtol": 2e-4, "atol": 2e-5}  # float32; float16 and bfloat16: 1e-2
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def load_both(model, **options) -> tuple:
    """(plain, optimized) models of `model` (a proto, bytes or path)."""
    return (runnx.load(model, optimization_level="disabled", **options),
            runnx.load(model, optimization_level="all", **options))


def assert_same(plain, optimized, what: str = "output", bitwise: bool = False) -> None:
    """`optimized` equals `plain`: bitwise but for floats (TOLERANCE unless `bitwise`), NaN where NaN,
    same dtype and shape."""
    if isinstance(plain, list) or isinstance(optimized, list):
        assert isinstance(plain, list) and isinstance(optimized, list) and len(plain) == len(optimized), what
        for index, (a, b) in enumerate(zip(plain, optimized)):
            assert_same(a, b, f"{what}[{index}]", bitwise)
        return
    if plain is None or optimized is None:
        assert plain is None and optimized is None, what
        return
    plain, optimized = np.asarray(plain), np.asarray(optimized)
    assert plain.dtype == optimized.dtype and plain.shape == optimized.shape, \
        f"{what}: {optimized.dtype}{optimized.shape} optimized, {plain.dtype}{plain.shape} plain"
    if bitwise:
        np.testing.assert_array_equal(optimized, plain, err_msg=what)
    elif plain.dtype.kind == "f" or plain.dtype.kind == "c" or plain.dtype.kind == "V":
        wide_plain, wide_optimized = plain.astype(np.complex128 if plain.dtype.kind == "c" else np.float64), \
            optimized.astype(np.complex128 if plain.dtype.kind == "c" else np.float64)
        tolerance = TOLERANCE if plain.dtype.itemsize >= 4 else {"rtol": 1e-2, "atol": 1e-2}
        np.testing.assert_allclose(wide_optimized, wide_plain, **tolerance, equal_nan=True, err_msg=what)
    elif plain.dtype == object:
        assert plain.tolist() == optimized.tolist(), what
    else:
        np.testing.assert_array_equal(optimized, plain, err_msg=what)


def assert_runs_agree(plain, optimized, feeds, outputs=None) -> dict:
    """Run both models on `feeds` (a callable making fresh feeds: Owned ones are handed over once)
    and compare every output; returns the plain outputs."""
    expected = plain.run(feeds(), outputs)
    got = optimized.run(feeds(), outputs)
    assert set(expected) == set(got)
    for name in expected:
        assert_same(expected[name], got[name], name)
    return expected


def fused_ops(model) -> set[str]:
    """The fused op types of a loaded model's graphs, shape memos' members and shape stand-ins included."""
    from runnx.interp.shape_cache import ShapeGroup
    found, graphs = set(), [model.graph]
    while graphs:
        nodes = list(graphs.pop().nodes)
        while nodes:
            node = nodes.pop()
            if node.domain == "runnx.fused":
                found.add(node.op_type)
            if isinstance(getattr(node.kernel, "fn", None), ShapeGroup):
                nodes += node.kernel.fn.members
            for sub in node.subgraphs.values():
                graphs += sub if isinstance(sub, list) else [sub]
    return found


# -- decoder-like graphs -------------------------------------------------------------------------


@dataclass
class DecoderShape:
    """The random sizes and constants of one generated decoder."""

    layers: int
    heads: int
    groups: int  # KV heads (heads % groups == 0)
    head_size: int  # even
    vocab: int
    style: str  # "llama" (RMSNorm, rotary, SiLU-gated MLP) or "gpt" (LayerNorm, GELU MLP)
    epsilon: float
    exponent: float  # RMSNorm's Pow: 2 as exported; else the matcher must leave it
    rotary_split: int  # the rotate-half split point (head_size // 2 as exported)
    scale: float
    nan_fill: float
    masked: tuple  # Where(mask, then, else)'s (then, else)
    gelu: tuple  # (divisor, one, half): (sqrt 2, 1, 0.5) as exported
    shape_readers: bool = False  # fused values also read for their shape (shape stand-ins), as exports do
    # products as onnxruntime.quantization.quantize_dynamic writes them (DynamicQuantizeLinear ->
    # MatMulInteger -> Cast -> Mul by the scales), and a token embedding DequantizeLinear(int8 table)
    # -> Gather(ids) added to the hidden input: "" none, "all" every product, "attention" the
    # attention's (the MLP's left float, as nodes_to_exclude leaves them); "nbits": every product
    # as the 4-bit MatMulNBits of matmul_nbits_quantizer (blocks of 32, zero points) and a llama
    # head tied to the embedding table, MatMul(h, DequantizeLinear(Transpose(table)))
    quantized: str = ""
    overridable: tuple = ()  # initializer names also listed as graph inputs
    # one product per layer for q/k/v and one for the MLP's first products, cut into pieces (llama:
    # Slices, the MLP's bounds from the product's shape, the rotary over the first Shape(cos)[-1]
    # columns; gpt: a biased product and a Split), as exports of fused projections write them
    fused_projections: bool = False
    seed: int = 0
    constants: dict = field(default_factory=dict)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size


def random_shape(rng: np.random.Generator, style: str, usual: bool, quantized: str = "") -> DecoderShape:
    """Random sizes; with usual=False, constants the fusion matchers do not expect (and quantized
    weights with per-column zero points)."""
    groups = int(rng.choice([1, 2]))
    heads = groups * int(rng.choice([1, 2, 3]))
    head_size = int(rng.choice([4, 8]))
    return DecoderShape(
        layers=int(rng.integers(1, 3)), heads=heads, groups=groups, head_size=head_size, vocab=int(rng.integers(5, 12)),
        style=style, epsilon=float(rng.choice([1e-5, 1e-6])) if usual else float(rng.choice([0.5, 3.0])),
        exponent=2.0 if usual else float(rng.choice([1.0, 3.0])),
        rotary_split=head_size // 2 if usual else int(rng.choice([1, head_size // 2 - 1, head_size - 1])),
        scale=float(head_size ** -0.25) if usual else float(rng.choice([-0.7, 1.9])),
        nan_fill=0.0 if usual else float(rng.choice([np.nan, 7.0])),
        masked=(0.0, float("-inf")) if usual else ((-1e4, 0.0) if rng.random() < 0.5 else (float("-inf"), 2.0)),
        gelu=(float(np.sqrt(2)), 1.0, 0.5) if usual else (float(rng.choice([1.3, 2.0])), float(rng.choice([0.5, 2.0])), 0.7),
        shape_readers=bool(rng.random() < 0.5), seed=int(rng.integers(2**31)), quantized=quantized)


class DecoderGraph:
    """Builds a decoder whose layers are written as exports write them (the patterns of
    runnx/interp/fusion/): inputs hidden (1, s, D), mask (1, 1, s, past + s) bool, cos and sin
    (1, 1, s, head_size), past_key.i / past_value.i (1, groups, past, head_size); outputs logits
    and present_key.i / present_value.i."""

    def __init__(self, shape: DecoderShape):
        self.shape = shape
        self.rng = np.random.default_rng(shape.seed)
        self.nodes, self.initializers = [], {}
        self.count = 0
        self.shape_outputs: list[str] = []  # Shape(...) of fused values, extra outputs

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def node(self, op: str, inputs: list, **attrs) -> str:
        out = self.fresh(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def constant(self, prefix: str, value) -> str:
        name = self.fresh(prefix)
        self.initializers[name] = np.asarray(value)
        return name

    def weight(self, rows: int, columns: int) -> str:
        return self.constant("w", (self.rng.standard_normal((rows, columns)) / np.sqrt(rows)).astype(np.float32))

    def f32(self, prefix: str, value) -> str:
        return self.constant(prefix, np.float32(value))

    def ints(self, prefix: str, values) -> str:
        return self.constant(prefix, np.array(values, np.int64))

    # blocks --------------------------------------------------------------------------------

    def rms_norm(self, x: str) -> str:
        s = self.shape
        power = self.node("Pow", [x, self.f32("exponent", s.exponent)])
        mean = self.node("ReduceMean", [power, self.ints("axes", [-1])], keepdims=1)
        var = self.node("Add", [mean, self.f32("epsilon", s.epsilon)])
        inverse = self.node("Div", [self.f32("one", 1.0), self.node("Sqrt", [var])])
        normed = self.node("Mul", [x, inverse])
        weight = (1 + 0.1 * self.rng.standard_normal(s.hidden)).astype(np.float32)
        return self.node("Mul", [self.constant("norm_weight", weight), normed])

    def layer_norm(self, x: str) -> str:
        s = self.shape
        scale = self.constant("ln_scale", (1 + 0.1 * self.rng.standard_normal(s.hidden)).astype(np.float32))
        bias = self.constant("ln_bias", (0.1 * self.rng.standard_normal(s.hidden)).astype(np.float32))
        return self.node("LayerNormalization", [x, scale, bias], axis=-1, epsilon=s.epsilon)

    def norm(self, x: str) -> str:
        return self.rms_norm(x) if self.shape.style == "llama" else self.layer_norm(x)

    def linear(self, x: str, rows: int, columns: int, bias: bool = False, part: str = "") -> str:
        quantized = self.shape.quantized == "all" and part or self.shape.quantized == part == "attention"
        if self.shape.quantized == "nbits" and part:
            y = self.four_bit_product(x, rows, columns)
        elif quantized:
            y = self.quantized_product(x, rows, columns)
        else:
            y = self.node("MatMul", [x, self.weight(rows, columns)])
        if bias:
            y = self.node("Add", [y, self.constant("b", (0.1 * self.rng.standard_normal(columns)).astype(np.float32))])
        return y

    def quantized_product(self, x: str, rows: int, columns: int) -> str:
        """x @ W as quantize_dynamic(weight_type=QInt8, reduce_range=True) writes it: x quantized to
        uint8 with its scale and zero point, W int8 in 7 bits (a zero point of 0; per column when
        the constants are unexpected), the int32 product cast and scaled by x's scale times W's."""
        w = self.rng.standard_normal((rows, columns)) / np.sqrt(rows)
        usual = self.shape.epsilon < 0.1
        zero = np.int8(0) if usual else self.rng.integers(-3, 4, columns).astype(np.int8)
        scale = (np.abs(w).max() if usual else np.abs(w).max(axis=0)) / 63
        w_q = np.clip(np.round(w / scale) + zero, -64, 63).astype(np.int8)
        quantized, x_scale, x_zero = self.fresh("x_q"), self.fresh("x_scale"), self.fresh("x_zero")
        self.nodes.append(helper.make_node("DynamicQuantizeLinear", [x], [quantized, x_scale, x_zero],
                                           name=quantized))
        product = self.node("MatMulInteger", [quantized, self.constant("w_q", w_q), x_zero,
                                              self.constant("w_zero", zero)])
        scales = self.node("Mul", [x_scale, self.constant("w_scale", np.asarray(scale, np.float32))])
        return self.node("Mul", [self.node("Cast", [product], to=F), scales])

    def four_bit_product(self, x: str, rows: int, columns: int) -> str:
        """x @ W as onnxruntime's MatMulNBits (4 bits, blocks of 32 along K, a scale and a packed
        zero point a block), W's values random in [0, 16)."""
        blocks = (rows + 31) // 32
        weights = self.rng.integers(0, 256, (columns, blocks, 16), dtype=np.uint8)
        scales = (0.02 + 0.02 * self.rng.random(columns * blocks)).astype(np.float32)
        zeros = self.rng.integers(0, 256, columns * ((blocks + 1) // 2), dtype=np.uint8)
        output = self.fresh("nbits")
        self.nodes.append(helper.make_node(
            "MatMulNBits", [x, self.constant("w_4", weights), self.constant("w_scales", scales),
                            self.constant("w_zeros", zeros)], [output], name=output, domain="com.microsoft",
            K=rows, N=columns, bits=4, block_size=32))
        return output

    def embedded(self, h: str) -> str:
        """h + Gather(DequantizeLinear(table), ids): a quantized token embedding (uint8, a zero point)."""
        s = self.shape
        table = self.rng.standard_normal((s.vocab, s.hidden)).astype(np.float32)
        scale = np.float32((table.max() - table.min()) / 255)
        zero = np.uint8(np.clip(np.round(-table.min() / scale), 0, 255))
        table_q = np.clip(np.round(table / scale) + zero, 0, 255).astype(np.uint8)
        self.table = [self.constant("table_q", table_q), self.constant("table_scale", scale),
                      self.constant("table_zero", zero)]
        dequantized = self.node("DequantizeLinear", self.table)
        return self.node("Add", [h, self.node("Gather", [dequantized, "ids"], axis=0)])

    def split_heads(self, x: str, heads: int) -> str:
        shaped = self.node("Reshape", [x, self.ints("heads_shape", [1, -1, heads, self.shape.head_size])])
        return self.node("Transpose", [shaped], perm=[0, 2, 1, 3])

    def rotary(self, x: str) -> str:
        split = self.shape.rotary_split
        last = self.ints("last", [-1])
        first = self.node("Slice", [x, self.ints("zero", [0]), self.ints("split", [split]), last])
        second = self.node("Slice", [x, self.ints("split", [split]), self.ints("end", [2**62]), last])
        rotated = self.node("Concat", [self.node("Neg", [second]), first], axis=-1)
        return self.node("Add", [self.node("Mul", [x, "cos"]), self.node("Mul", [rotated, "sin"])])

    def repeat(self, cache: str) -> str:
        """The grouped-query head repeat (Unsqueeze, Expand, Reshape), its targets from the cache's shape."""
        s = self.shape
        shape = self.node("Shape", [cache])
        front = self.node("Slice", [shape, self.ints("zero", [0]), self.ints("two", [2])])
        back = self.node("Slice", [shape, self.ints("two", [2]), self.ints("four", [4])])
        expand = self.node("Concat", [front, self.ints("repeat", [s.heads // s.groups]), back], axis=0)
        length = self.node("Slice", [shape, self.ints("two", [2]), self.ints("three", [3])])
        target = self.node("Concat", [self.ints("one_heads", [1, s.heads]), length, self.ints("size", [s.head_size])],
                           axis=0)
        unsqueezed = self.node("Unsqueeze", [cache, self.ints("axis", [2])])
        return self.node("Reshape", [self.node("Expand", [unsqueezed, expand]), target])

    def cut(self, product: str, bounds: list) -> list[str]:
        """Slices of the product's columns (axis 2: its rank is known), one per (start, end)."""
        return [self.node("Slice", [product, self.ints("start", [a]), self.ints("stop", [b]), self.ints("axis", [2])])
                for a, b in bounds]

    def halves(self, product: str) -> list[str]:
        """The product's two halves, the bounds computed from its shape as Optimum's exports do."""
        last = self.ints("last", [-1])
        width = self.node("Gather", [self.node("Shape", [product]), last], axis=0)
        half = self.node("Div", [self.node("Add", [width, self.ints("one", [1])]), self.ints("two", [2])])
        middle, end = self.node("Mul", [half, self.ints("one", [1])]), self.node("Mul", [half, self.ints("two", [2])])
        return [self.node("Slice", [product, self.ints("zero", [0]), middle, last]),
                self.node("Slice", [product, middle, end, last])]

    def projections(self, x: str) -> list[str]:
        """The query, key and value products."""
        s = self.shape
        kv = s.groups * s.head_size
        if not s.fused_projections:
            return [self.linear(x, s.hidden, columns, part="attention") for columns in (s.hidden, kv, kv)]
        product = self.linear(x, s.hidden, s.hidden + 2 * kv, bias=s.style == "gpt", part="attention")
        if s.style == "gpt":
            pieces = [self.fresh("piece") for _ in range(3)]
            self.nodes.append(helper.make_node("Split", [product, self.ints("sizes", [s.hidden, kv, kv])], pieces,
                                               name=pieces[0], axis=-1))
            return pieces
        return self.cut(product, [(0, s.hidden), (s.hidden, s.hidden + kv), (s.hidden + kv, 2**62)])

    def rotary_prefix(self, x: str) -> str:
        """The rotary embedding of x's first Shape(cos)[-1] columns, the rest (none) passed through."""
        width = self.node("Gather", [self.node("Shape", ["cos"]), self.constant("minus_one", np.array(-1))], axis=0)
        width = self.node("Unsqueeze", [width, self.ints("zero", [0])])
        last = self.ints("last", [-1])
        rotated = self.rotary(self.node("Slice", [x, self.ints("zero", [0]), width, last]))
        passed = self.node("Slice", [x, width, self.ints("end", [2**62]), last])
        return self.node("Concat", [rotated, passed], axis=-1)

    def attention(self, x: str, layer: int, mask: str = "mask") -> str:
        s = self.shape
        query, key, value = self.projections(x)
        query = self.split_heads(query, s.heads)
        key, value = (self.split_heads(v, s.groups) for v in (key, value))
        if s.style == "llama":
            rotary = self.rotary_prefix if s.fused_projections else self.rotary
            query, key = rotary(query), rotary(key)
        keys = self.named("Concat", [f"past_key.{layer}", key], f"present_key.{layer}", axis=2)
        values = self.named("Concat", [f"past_value.{layer}", value], f"present_value.{layer}", axis=2)
        scale = self.f32("scale", s.scale)
        scores = self.node("MatMul", [self.node("Mul", [query, scale]), self.node("Mul", [
            self.node("Transpose", [self.repeat(keys)], perm=[0, 1, 3, 2]), scale])])
        cut = self.node("Slice", [mask, self.ints("zero", [0]), self.ints("end", [2**62]), self.ints("last", [-1])])
        bias = self.node("Where", [cut, self.f32("then", s.masked[0]), self.f32("else", s.masked[1])])
        p = self.node("Softmax", [self.node("Add", [scores, bias])], axis=-1)
        filled = self.node("Where", [self.node("IsNaN", [p]), self.f32("fill", s.nan_fill), p])
        heads = self.node("MatMul", [filled, self.repeat(values)])
        target = self.ints("merged", [0, 0, -1])
        if s.shape_readers:  # the merged heads' target from the norm's shape, as Optimum's exports read it
            batch_and_length = self.node("Slice", [self.node("Shape", [x]), self.ints("zero", [0]), self.ints("two", [2])])
            target = self.node("Concat", [batch_and_length, self.ints("minus_one", [-1])], axis=0)
            self.shape_outputs += [self.node("Shape", [self.repeat(keys)]), self.node("Shape", [query])]
        merged = self.node("Reshape", [self.node("Transpose", [heads], perm=[0, 2, 1, 3]), target])
        return self.linear(merged, s.hidden, s.hidden, bias=s.style == "gpt", part="attention")

    def mlp(self, x: str) -> str:
        s = self.shape
        inner = 2 * s.hidden
        if s.style == "llama":
            if s.fused_projections:
                gate, up = self.halves(self.linear(x, s.hidden, 2 * inner, part="mlp"))
            else:
                gate, up = (self.linear(x, s.hidden, inner, part="mlp") for _ in range(2))
            silu = self.node("Mul", [gate, self.node("Sigmoid", [gate])])
            return self.linear(self.node("Mul", [silu, up]), inner, s.hidden, part="mlp")
        divisor, one, half = s.gelu
        v = self.linear(x, s.hidden, inner, bias=True, part="mlp")
        erf = self.node("Erf", [self.node("Div", [v, self.f32("divisor", divisor)])])
        gelu = self.node("Mul", [self.node("Mul", [v, self.node("Add", [erf, self.f32("one", one)])]),
                                 self.f32("half", half)])
        return self.linear(gelu, inner, s.hidden, bias=True, part="mlp")

    def named(self, op: str, inputs: list, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def model(self) -> onnx.ModelProto:
        h = self.embedded("hidden") if self.shape.quantized else "hidden"
        for layer in range(self.shape.layers):
            h = self.node("Add", [h, self.attention(self.norm(h), layer)])
            h = self.node("Add", [h, self.mlp(self.norm(h))])
        return self.finish(h)

    def finish(self, h: str) -> onnx.ModelProto:
        """The model of the nodes so far, its logits the head of the norm of `h`."""
        s = self.shape
        if s.style == "gpt":  # a biased head
            self.named("Add", [self.linear(self.norm(h), s.hidden, s.vocab),
                               self.constant("b", (0.1 * self.rng.standard_normal(s.vocab)).astype(np.float32))], "logits")
        elif s.quantized == "nbits":  # tied to the quantized embedding table
            head = self.node("DequantizeLinear", [self.node("Transpose", [self.table[0]]), *self.table[1:]])
            self.named("MatMul", [self.norm(h), head], "logits")
        else:
            self.named("MatMul", [self.norm(h), self.weight(s.hidden, s.vocab)], "logits")
        kv = [(f"{kind}.{layer}", s.groups) for layer in range(s.layers) for kind in ("past_key", "past_value")]
        inputs = [helper.make_tensor_value_info("hidden", F, [1, "s", s.hidden]),
                  helper.make_tensor_value_info("mask", BOOL, [1, 1, "s", "t"]),
                  helper.make_tensor_value_info("cos", F, [1, 1, "s", s.head_size]),
                  helper.make_tensor_value_info("sin", F, [1, 1, "s", s.head_size])]
        inputs += [helper.make_tensor_value_info(name, F, [1, groups, "p", s.head_size]) for name, groups in kv]
        if s.quantized:
            inputs.append(helper.make_tensor_value_info("ids", I64, [1, "s"]))
        self.constants = dict(self.initializers)
        for name in s.overridable:
            value = self.initializers[name]
            inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
        outputs = [helper.make_tensor_value_info("logits", F, [1, "s", s.vocab])]
        outputs += [helper.make_tensor_value_info(name.replace("past", "present"), F, None) for name, _ in kv]
        outputs += [helper.make_tensor_value_info(name, I64, None) for name in self.shape_outputs]
        graph = helper.make_graph(self.nodes, f"decoder_{s.style}", inputs, outputs,
                                  [numpy_helper.from_array(v, k) for k, v in self.initializers.items()])
        opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid("com.microsoft", 1)] if s.quantized == "nbits" else [])
        return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def decoder(shape: DecoderShape, overridable: tuple = ()) -> tuple[onnx.ModelProto, dict]:
    """(model, its constants); initializers of the kinds named in `overridable` (their names'
    prefixes: "epsilon", "w", ...) are also graph inputs."""
    builder = DecoderGraph(shape)
    builder.model()
    names = tuple(n for n in builder.initializers if n.rsplit("_", 1)[0] in overridable)
    shape.overridable = names
    builder = DecoderGraph(shape)
    return builder.model(), builder.constants


def step_feeds(shape: DecoderShape, rng, past: int, new: int) -> dict:
    """A step's feeds but the caches: `new` positions after `past`, a causal mask (sometimes
    masking the first position as padding does), rotary tables of the positions."""
    s = shape
    total = past + new
    causal = np.tril(np.ones((new, total), bool), k=past)
    if past and rng.random() < 0.5:
        causal[:, 0] = False
    angles = np.outer(np.arange(past, total), 1.0 / (10000 ** (np.arange(s.head_size) / s.head_size)))
    ids = {"ids": rng.integers(0, s.vocab, (1, new))} if s.quantized else {}
    return {**ids, "hidden": rng.standard_normal((1, new, s.hidden)).astype(np.float32),
            "mask": causal.reshape(1, 1, new, total),
            "cos": np.cos(angles).astype(np.float32).reshape(1, 1, new, s.head_size),
            "sin": np.sin(angles).astype(np.float32).reshape(1, 1, new, s.head_size)}


def kv_names(shape: DecoderShape) -> list[str]:
    return [f"{kind}.{layer}" for layer in range(shape.layers) for kind in ("past_key", "past_value")]


def decode_and_compare(plain, optimized, shape: DecoderShape, seed: int, steps: int = 4, extra=None,
                       dtype=np.float32) -> None:
    """A prompt after a random past, then `steps` one-position steps, on both models: each model's
    caches its own presents handed back as runnx.Owned (the first in capacity buffers, as
    runnx.generate does); every step's outputs compared (bitwise when the decoder is quantized).
    `extra` feeds are added to every step; float feeds and caches in `dtype` (a float16 model's)."""
    rng = np.random.default_rng(seed)
    past, new = int(rng.integers(0, 4)), int(rng.integers(1, 4))
    first = {n: rng.standard_normal((1, shape.groups, past, shape.head_size)).astype(dtype)
             for n in kv_names(shape)}
    caches = {id(plain): {n: runnx.with_capacity(v, 2, 64) for n, v in first.items()},
              id(optimized): {n: runnx.with_capacity(v.copy(), 2, 64) for n, v in first.items()}}
    for step in range(steps + 1):
        feeds = {**step_feeds(shape, rng, past, new), **(extra or {})}
        feeds = {n: v.astype(dtype) if v.dtype == np.float32 else v for n, v in feeds.items()}
        results = {}
        for model in (plain, optimized):
            outputs = model.run({**feeds, **caches[id(model)]})
            caches[id(model)] = {n: runnx.Owned(outputs[n.replace("past", "present")]) for n in kv_names(shape)}
            results[id(model)] = outputs
        for name, expected in results[id(plain)].items():
            assert_same(expected, results[id(optimized)][name], f"step {step}: {name}",
                        bitwise=shape.quantized in ("all", "attention"))
        past, new = past + new, 1


def mask_rewritten_in_place() -> tuple[onnx.ModelProto, DecoderShape]:
    """Two attention layers: the first reads mask m = Not(mask); then m's object is written in
    place by Xor(m, True) (its last reader, run after the first layer: it reads that layer's sum),
    whose value, the fed mask again, the second layer reads. Both layers' Where(Slice(m)) biases
    are made by the fused attention (`_mask_bias`, kept per run by identity)."""
    shape = random_shape(np.random.default_rng(7), "llama", usual=True)
    shape.layers = 2
    b = DecoderGraph(shape)
    inverted = b.node("Not", ["mask"])
    h = b.node("Add", ["hidden", b.attention(b.norm("hidden"), 0, mask=inverted)])
    flip = b.node("Less", [b.node("ReduceMax", [h], keepdims=0), b.f32("huge", 1e30)])
    again = b.node("Xor", [inverted, flip])
    h = b.node("Add", [h, b.attention(b.norm(h), 1, mask=again)])
    return b.finish(h), shape
