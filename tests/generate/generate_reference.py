"""onnxruntime driving an Optimum decoder export greedily: the reference the generation tests compare
runnx against. Written independently of runnx.generate (plain dicts, no capacity, no name discovery
beyond the `past_key_values.` -> `present.` rule of the exports)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort


_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # past key/values as the model declares


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_greedy(first_path, with_past_path, prompt_ids, new_tokens: int) -> list[int]:
    """Greedy token ids; `first_path` runs the prompt, `with_past_path` every later step (the same
    file for model.onnx and decoder_model_merged.onnx)."""
    first = session(first_path)
    with_past = first if str(with_past_path) == str(first_path) else session(with_past_path)
    cache = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), _DTYPES[i.type])
             for i in with_past.get_inputs() if i.name.startswith("past_key_values.")}
    ids, seen, out = list(prompt_ids), 0, []
    for step in range(new_tokens):
        sess = first if step == 0 else with_past
        names = {i.name for i in sess.get_inputs()}
        total = seen + len(ids)
        feed = {"input_ids": np.array([ids], np.int64)}
        if "attention_mask" in names:
            feed["attention_mask"] = np.ones((1, total), np.int64)
        if "position_ids" in names:
            feed["position_ids"] = np.arange(seen, total, dtype=np.int64)[None]
        if "use_cache_branch" in names:
            feed["use_cache_branch"] = np.array([step > 0])
        feed.update({name: value for name, value in cache.items() if name in names})
        outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
        token = int(outputs["logits"][0, -1].argmax())
        out.append(token)
        cache = {name: outputs[name.replace("past_key_values.", "present.")] for name in cache}
        seen, ids = total, [token]
    return out
