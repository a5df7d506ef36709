"""LinearAttention against its recurrence written per head with loops; FlexAttention against softmax
attention, with a score_mod subgraph run through a real model."""
import numpy as np
import pytest
from _single_node import run_node
from onnx import TensorProto, helper

import runnx
from runnx.errors import RunnxError
from runnx.ops.attention_variants import FlexAttention

RNG = np.random.default_rng(27)


def recurrence(q, k, v, state, decay, beta, q_heads, kv_heads, scale):
    """The gated delta rule, one batch row, head and token at a time ([B, T, H*D] layouts)."""
    batch, time, _ = q.shape
    dk, dv = q.shape[2] // q_heads, v.shape[2] // kv_heads
    state = state.astype(np.float64).copy()
    out = np.zeros((batch, time, q_heads * dv))
    for b in range(batch):
        for t in range(time):
            for h in range(kv_heads):
                key, value = k[b, t, h * dk:(h + 1) * dk], v[b, t, h * dv:(h + 1) * dv]
                state[b, h] *= np.exp(decay[b, t, h])
                value = beta[b, t, h] * (value - state[b, h].T @ key)
                state[b, h] += np.outer(key, value)
            for h in range(q_heads):
                query = q[b, t, h * dk:(h + 1) * dk]
                out[b, t, h * dv:(h + 1) * dv] = scale * state[b, h // (q_heads // kv_heads)].T @ query
    return out, state


def test_linear_attention_gated_delta_grouped_heads_with_past():
    batch, time, q_heads, kv_heads, dk, dv = 2, 3, 4, 2, 3, 5
    q = RNG.standard_normal((batch, time, q_heads * dk)).astype(np.float32)
    k = RNG.standard_normal((batch, time, kv_heads * dk)).astype(np.float32) * 0.5
    v = RNG.standard_normal((batch, time, kv_heads * dv)).astype(np.float32)
    past = RNG.standard_normal((batch, kv_heads, dk, dv)).astype(np.float32)
    decay = -RNG.random((batch, time, kv_heads)).astype(np.float32)
    beta = RNG.random((batch, time, kv_heads)).astype(np.float32)
    out, state = run_node("LinearAttention", [q, k, v, past, decay, beta], outputs=2, opset=27,
                          q_num_heads=q_heads, kv_num_heads=kv_heads)
    expected_out, expected_state = recurrence(q, k, v, past, decay, beta, q_heads, kv_heads, 1 / np.sqrt(dk))
    assert out.dtype == state.dtype == np.float32
    np.testing.assert_allclose(out, expected_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, expected_state, rtol=1e-4, atol=1e-5)


def test_linear_attention_rule_inputs_are_checked():
    x = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(RunnxError, match="needs decay"):
        run_node("LinearAttention", [x, x, x], outputs=2, opset=27, q_num_heads=2, kv_num_heads=2,
                 update_rule="gated")


def softmax_attention(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    scores = scale * q @ np.repeat(k, group, axis=1).swapaxes(-1, -2)
    probabilities = np.exp(scores - scores.max(-1, keepdims=True))
    return probabilities / probabilities.sum(-1, keepdims=True) @ np.repeat(v, group, axis=1)


def test_flex_attention_without_modifiers_is_softmax_attention():
    q, k, v = (RNG.standard_normal(shape) for shape in ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6)))
    np.testing.assert_allclose(FlexAttention(q, k, v), softmax_attention(q, k, v, 1 / np.sqrt(8)), rtol=1e-12)
    half = FlexAttention(*(x.astype(np.float16) for x in (q, k, v)), scale=0.5)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, softmax_attention(q, k, v, 0.5), atol=2e-2)


def test_flex_attention_score_mod_subgraph():
    q, k, v = (RNG.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    doubled = helper.make_graph(
        [helper.make_node("Add", ["s", "s"], ["out"])], "double",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    node = helper.make_node("FlexAttention", ["q", "k", "v"], ["y"], domain="ai.onnx.preview", score_mod=doubled)
    graph = helper.make_graph([node], "flex", [helper.make_tensor_value_info(n, TensorProto.FLOAT, x.shape)
                                               for n, x in zip("qkv", (q, k, v))],
                              [helper.make_value_info("y", helper.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid("ai.onnx.preview", 1)])
    got = runnx.load(model).run({"q": q, "k": k, "v": v})["y"]
    np.testing.assert_allclose(got, softmax_attention(q, k, v, 2 / np.sqrt(4)), rtol=1e-5, atol=1e-6)
