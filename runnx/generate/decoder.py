"""One decoder step at a time, with the self-attention KV cache appended in place.

Usage (any Optimum decoder export; Whisper's decoder the same way)::

    from runnx.generate.decoder import DecoderStep
    decoder = DecoderStep.from_folder("whisper-tiny.en", capacity=448)   # or DecoderStep(model[, with_past])
    decoder.reset(batch_size=1, fixed_feeds={"encoder_hidden_states": hidden})
    logits = decoder.step(np.array([[50257, 50362]]))   # (batch, 1, vocab); first step = prefill
    logits = decoder.step(np.array([[next_id]]))        # later steps append to the cache
    decoder.length                                       # tokens in the cache

What it does for you:

- Folders: `from_folder` reads any layout `layouts.py` knows (Optimum, transformers.js with a
  `variant`, onnxruntime-genai: names from genai_config.json, its shared KV buffer).
- Names: inputs/outputs are discovered by `DecoderIO` (io_names.py) for the three export shapes
  (`model.onnx`; `decoder_model_merged.onnx`, where it feeds `use_cache_branch` False on the first
  step and True afterwards; `decoder_model.onnx` for the first step + `decoder_with_past_model.onnx`).
  `attention_mask`, `position_ids` (from the mask: left padding works) and `cache_position` are
  built when the model has them; the caller passes only input ids (and, for padding, the new tokens'
  mask as `step(ids, attention_mask=...)`).
- Self-attention KV (`past_key_values.N[.decoder].key|value`): a `KVCache` with `capacity` rows,
  handed to the model as `runnx.Owned` each step so that Concat appends in place; the `present.*`
  outputs (views of the same buffers) become the cache. Short of room, it doubles.
- Cross-attention KV (`.encoder.`): taken from the *first* step's `present.*.encoder.*` outputs and
  fed unchanged (read-only) to every later step; later steps' encoder presents are ignored (the
  merged Whisper decoder returns dummies there with use_cache_branch=True).
- Fixed feeds (`encoder_hidden_states`, ...): given once to `reset`, fed to every step whose model
  has that input (decoder_with_past_model.onnx does not take it).
- `profile=runnx.Profile()` accumulates every step's profile (in-place counters for tests).
- Logits: `from_folder` loads with `load_decoder`, whose models compute the LM head for the last
  position only (`runnx.load(..., last_position=("logits",))`): `step` returns (batch, 1, vocab).
  A model loaded without it gives every new position's logits, (batch, new tokens, vocab).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np

from runnx.capture.ownership import read_only_view
from runnx.generate.io_names import DecoderIO, DecoderIOError, KVName
from runnx.generate.layouts import FolderLayout, read_folder
from runnx.generate.kv_cache import SEQUENCE_AXIS, KVCache, SpareBuffers
from runnx.interp.dtypes import numpy_dtype
from runnx.interp.model import load as runnx_load
from runnx.interp.quiet import BUSY
from runnx.runtime import start_pool_in_background


class DecoderStep:
    """Runs a decoder one step at a time and owns its KV cache (see the module docstring)."""

    def __init__(self, model, with_past=None, *, capacity: int = 256, config: dict | None = None, profile=None,
                 io: DecoderIO | None = None, share_buffer: bool = False, context_length: int | None = None,
                 padding: bool = True):
        """`model` runs the first step (and every step when `with_past` is None); `config` (the
        model's config.json) is only needed when the past inputs do not declare heads/head_dim.
        Load merged decoders with `runnx.load(path, check_symbolic_dims=False)` (or use
        `load_decoder`): their attention_mask and input_ids share a misnamed symbolic length.
        `io` gives the roles of the inputs and outputs when a config names them (layouts.py);
        `share_buffer` feeds each whole KV buffer as past, which the model writes in place and
        returns as present (onnxruntime-genai's past_present_share_buffer); `context_length`
        bounds the tokens a step may reach; `padding=False` refuses padded rows (GroupQueryAttention
        models find each row's length from the mask, so rows must not be left-padded)."""
        self.first_model = model
        self.past_model = with_past if with_past is not None else model
        self.first_io = io or DecoderIO.of(model)
        self.past_io = io or DecoderIO.of(self.past_model)
        self.share_buffer = share_buffer
        self.context_length = context_length
        self.padding = padding
        if not self.past_io.takes_past:
            raise DecoderIOError("the decoder takes no past_key_values: it cannot be run step by step with a cache")
        self.capacity = capacity
        self.profile = profile
        self._layout = _kv_layout(self.past_model, self.past_io, config or {})
        past_name = {k.slot: k.past for k in self.past_io.kv}
        # per step kind (first or not): the outputs to ask for, and the presents that become the self-
        # attention cache (past name, present name); the first step's cross-attention presents
        steps = ((True, self.first_io), (False, self.past_io))
        self._wanted = {first: [io.logits] + [k.present for k in io.kv
                                              if k.present and (first or not k.is_cross_attention)]
                        for first, io in steps}
        self._self_presents = {first: [(past_name[k.slot], k.present) for k in io.kv
                                       if k.present and not k.is_cross_attention]
                               for first, io in steps}
        self._cross_presents = [(past_name[k.slot], k.present) for k in self.first_io.kv
                                if k.present and k.is_cross_attention]
        self._cross_pasts = [k.past for k in self.past_io.kv if k.is_cross_attention and k.past]
        self._ids_dtype = _input_dtype(model, self.first_io.input_ids, np.dtype(np.int64))
        self.reset()
        with BUSY:  # the first prefill's cache, made with the load (no settling collapse beside it: `step`)
            self._spare = SpareBuffers.made(*self._cache_layout(self.first_io), capacity, share_buffer)
        for first, decoder in ((True, self.first_model), (False, self.past_model)):
            plan_ahead = getattr(decoder, "plan_ahead", None)  # a runnx Model's (tests step onnxruntime's too)
            if plan_ahead is not None:
                plan_ahead(self._wanted[first])
        self._prepacking = []  # threads making weights' tiles beside the first prompt (`Model.prepack_in_background`)
        for decoder in {id(m): m for m in (self.first_model, self.past_model)}.values():
            prepack = getattr(decoder, "prepack_in_background", None)  # a runnx Model's (tests step onnxruntime's too)
            if prepack is not None and (thread := prepack()) is not None:
                self._prepacking.append(thread)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until the weights the decoder's models prepack in the background are made (a 4-bit
        weight's tiles: `Model.prepack_in_background`), as onnxruntime's session creation does
        before it returns; whether they are (False: `timeout` seconds passed first). Steps never
        need it (a step reaching a weight first makes its tiles itself), but until then they share
        the cores with the prepacking: a server or a benchmark wanting steady steps from the first
        waits here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._prepacking:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._prepacking)

    @classmethod
    def from_folder(cls, folder, *, capacity: int = 256, profile=None, load=None, variant: str | None = None,
                    share_buffer: bool | None = None, layout: FolderLayout | None = None) -> "DecoderStep":
        """Load the decoder of a folder in any layout `layouts.read_folder` reads (Optimum,
        transformers.js with its `variant`, onnxruntime-genai); `load` defaults to `load_decoder`;
        `share_buffer` None: as the folder's config says."""
        load = load or load_decoder
        layout = layout or read_folder(folder, variant)
        files = layout.files
        start_pool_in_background(files.first)  # beside the loads
        first = load(str(files.first))
        with_past = load(str(files.with_past)) if files.with_past != files.first else None
        genai = layout.kind == "onnxruntime-genai"
        return cls(first, with_past, capacity=capacity, config=layout.config, profile=profile,
                   io=layout.decoder_io(first), share_buffer=layout.share_buffer if share_buffer is None else share_buffer,
                   context_length=layout.context_length if genai else None, padding=not genai)

    # -- state -------------------------------------------------------------------------------
    def reset(self, batch_size: int = 1, fixed_feeds: dict | None = None) -> None:
        """Forget everything: the next step is a prefill (into the cache's buffers again, where they fit
        and nothing else holds them: `SpareBuffers`)."""
        self.batch_size = batch_size
        self.fixed_feeds = dict(fixed_feeds or {})
        cache = getattr(self, "cache", None)
        if cache is not None:
            self._spare = cache.spare()
        self.cache: KVCache | None = None  # self-attention KV, keyed by the past input names
        self.cross: dict[str, np.ndarray] = {}  # cross-attention KV from the first step
        self.attention_mask = np.zeros((batch_size, 0), np.int64)

    @property
    def length(self) -> int:
        """Number of tokens (per row, padding included) in the cache."""
        return self.attention_mask.shape[1]

    @property
    def started(self) -> bool:
        return self.cache is not None

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` (a cheap shortening of views: the capacity stays)."""
        if self.cache is None or length >= self.length:
            return
        index = (slice(None),) * SEQUENCE_AXIS + (slice(0, length),)
        self.cache.accept({name: array[index] for name, array in self.cache.arrays.items()})
        self.attention_mask = self.attention_mask[:, :length]

    def kv_arrays(self) -> dict[str, np.ndarray]:
        """Exact-size copies of the KV tensors (self- and cross-attention), keyed by past input name."""
        arrays = self.cache.copy_arrays() if self.cache is not None else {}
        arrays.update({name: a.copy() for name, a in self.cross.items()})
        return arrays

    def restore(self, arrays: dict[str, np.ndarray], attention_mask: np.ndarray, fixed_feeds=None) -> None:
        """Continue from saved `kv_arrays()` and the attention mask that goes with them."""
        attention_mask = np.asarray(attention_mask, np.int64)
        self.reset(attention_mask.shape[0], fixed_feeds)
        for kv in self.past_io.kv:
            array = arrays.get(kv.past)
            heads, head_dim, dtype = self._layout[kv.slot]
            if array is None or array.ndim != 4 or (array.shape[1], array.shape[3], array.dtype) != (heads, head_dim, dtype):
                found = "missing" if array is None else f"{array.dtype}{list(array.shape)}"
                raise DecoderIOError(f"saved state does not fit this model: '{kv.past}' is {found}, the model "
                                     f"takes {dtype}[batch, {heads}, length, {head_dim}]")
        self_names = [k.past for k in self.past_io.kv if not k.is_cross_attention]
        self.cache = KVCache.with_capacity({n: arrays[n] for n in self_names},
                                           max(self.capacity, 2 * attention_mask.shape[1]), zeroed=self.share_buffer,
                                           spare=self._take_spare())
        self.cross = {k.past: read_only_view(arrays[k.past]) for k in self.past_io.kv if k.is_cross_attention}
        self.attention_mask = attention_mask

    # -- one step ------------------------------------------------------------------------------
    def step(self, input_ids, attention_mask=None) -> np.ndarray:
        """Run the model on `input_ids` [batch, new] and return the logits [batch, new, vocab] (the
        last position's, [batch, 1, vocab], from a model loaded by `load_decoder`).
        `attention_mask` [batch, new] marks padding among the new tokens (default: all ones)."""
        input_ids = np.ascontiguousarray(input_ids, dtype=self._ids_dtype)  # int64, int32 for some exports
        if input_ids.ndim != 2 or input_ids.shape[0] != self.batch_size:
            raise DecoderIOError(f"input_ids must be [batch={self.batch_size}, new tokens], got {list(input_ids.shape)}")
        new_mask = (np.ones(input_ids.shape, np.int64) if attention_mask is None
                    else np.asarray(attention_mask, np.int64))
        first = not self.started
        model = self.first_model if first else self.past_model
        recording = getattr(model, "recording_loads", None)  # a runnx Model's (tests step onnxruntime's too)
        # busy from here (`quiet.py`), not from the run's start: a settling collapse beside the cache's
        # first allocation stalled each of its heap growths for the collapse of a huge page (5-12 ms)
        with BUSY, recording() if recording is not None else nullcontext():  # its cache's kernels are the model's
            return self._step(model, first, input_ids, new_mask)

    def _step(self, model, first: bool, input_ids: np.ndarray, new_mask: np.ndarray) -> np.ndarray:
        new = input_ids.shape[1]
        io = self.first_io if first else self.past_io
        full_mask = np.concatenate([self.attention_mask, new_mask], axis=1)
        if self.context_length is not None and full_mask.shape[1] > self.context_length:
            raise DecoderIOError(f"{full_mask.shape[1]} tokens exceed the model's context length of "
                                 f"{self.context_length}")
        if not self.padding and not new_mask.all():
            raise DecoderIOError("this model finds each row's length from the attention mask (GroupQueryAttention): "
                                 "rows cannot be padded; run prompts of unequal length one by one")

        feeds = {io.input_ids: input_ids}
        if io.attention_mask:
            feeds[io.attention_mask] = full_mask
        if io.position_ids:
            feeds[io.position_ids] = _positions(full_mask, new)
        if io.cache_position:
            feeds[io.cache_position] = np.arange(self.length, self.length + new, dtype=np.int64)
        if io.use_cache_branch:
            feeds[io.use_cache_branch] = _USE_CACHE_BRANCH[not first]
        for name in io.other_inputs:
            if name in self.fixed_feeds:
                feeds[name] = self.fixed_feeds[name]
        feeds.update(self._past_feeds(io, first, new))

        run_kwargs = {"profile": self.profile} if self.profile is not None else {}
        outputs = model.run(feeds, self._wanted[first], **run_kwargs)
        self._take_presents(outputs, first, full_mask.shape[1])
        self.attention_mask = full_mask
        return outputs[io.logits]

    def _past_feeds(self, io: DecoderIO, first: bool, new: int) -> dict:
        if not io.takes_past:
            return {}
        if not first:
            feeds = self.cache.handover(new, whole=self.share_buffer)
            cross = self.cross
            for name in self._cross_pasts:
                feeds[name] = cross[name]
            return feeds
        if io.use_cache_branch:  # merged decoder, first step: the past is ignored but must be fed
            return {k.past: self._empty(k) for k in io.kv if k.past}
        # model.onnx: the prefill appends into the reserved buffers already
        self.cache = KVCache.empty(*self._cache_layout(io), self.capacity, zeroed=self.share_buffer,
                                   spare=self._take_spare())
        feeds = self.cache.handover(new, whole=self.share_buffer)
        feeds.update({k.past: self._empty(k) for k in io.kv if k.past and k.is_cross_attention})
        return feeds

    def _cache_layout(self, io: DecoderIO) -> tuple[dict, dict]:
        """The self-attention cache's shapes ([batch, heads, 0, head_dim]) and dtypes, by past name."""
        self_attention = [k for k in io.kv if k.past and not k.is_cross_attention]
        return ({k.past: self._empty_shape(k) for k in self_attention},
                {k.past: self._layout[k.slot][2] for k in self_attention})

    def _take_spare(self):
        """The last reset's buffers, once (what the new cache does not take is freed with them)."""
        spare, self._spare = self._spare, None
        return spare

    def _take_presents(self, outputs: dict, first: bool, length: int) -> None:
        self_presents = {past: outputs[present] for past, present in self._self_presents[first]}
        if first:  # read-only, so that every step feeds these same arrays (not new read-only views of them)
            self.cross = {past: read_only_view(outputs[present]) for past, present in self._cross_presents}
        if self.cache is None:  # a prefill without past inputs returned exact-size arrays
            self.cache = KVCache.with_capacity(self_presents, self.capacity, zeroed=self.share_buffer,
                                               spare=self._take_spare())
        else:
            self.cache.accept(self_presents, length if self.share_buffer else None)

    def _empty_shape(self, kv: KVName) -> tuple:
        heads, head_dim, _ = self._layout[kv.slot]
        return (self.batch_size, heads, 0, head_dim)

    def _empty(self, kv: KVName) -> np.ndarray:
        return np.zeros(self._empty_shape(kv), self._layout[kv.slot][2])


# use_cache_branch's feeds: read-only, held by Model.run as they are
_USE_CACHE_BRANCH = {flag: read_only_view(np.array([flag])) for flag in (False, True)}


def load_decoder(path):
    """runnx.load for generation: without the symbolic-dimension check (merged exports misname the
    attention_mask length) and with the logits of the last position only (interp/last_position.py)."""
    return runnx_load(path, check_symbolic_dims=False, last_position=("logits",))


def _positions(mask: np.ndarray, new: int) -> np.ndarray:
    """position_ids of the last `new` tokens: count of real tokens before each one (as transformers
    computes them from the attention mask), 1 on padding."""
    positions = np.cumsum(mask, axis=1) - 1
    positions[mask == 0] = 1
    return positions[:, -new:].astype(np.int64)


def _input_dtype(model, name: str, default: np.dtype) -> np.dtype:
    """The element type `model` declares for its input `name` (default when it declares none)."""
    info = next((info for info in getattr(model, "inputs", ()) if info.name == name), None)
    return numpy_dtype(info.elem_type) if info is not None and info.elem_type else default


def _kv_layout(model, io: DecoderIO, config: dict) -> dict:
    """(heads, head_dim, dtype) per KV slot, from the past inputs' declared shapes or the config."""
    infos = {info.name: info for info in getattr(model, "inputs", ())}
    layout = {}
    for kv in io.kv:
        if not kv.past:
            continue
        info = infos.get(kv.past)
        shape = info.shape if info is not None and info.shape is not None else (None,) * 4
        heads, head_dim = shape[1], shape[3]
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            heads, head_dim = _layout_from_config(config, kv)
        dtype = numpy_dtype(info.elem_type) if info is not None and info.elem_type else np.dtype(np.float32)
        layout[kv.slot] = (heads, head_dim, dtype)
    return layout


def _layout_from_config(config: dict, kv: KVName) -> tuple[int, int]:
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads") or config.get("n_head")
    if kv.group:
        heads = config.get(f"{kv.group}_attention_heads", heads)
    hidden = config.get("hidden_size") or config.get("d_model") or config.get("n_embd")
    total_heads = config.get("num_attention_heads") or config.get("n_head") or heads
    head_dim = config.get("head_dim") or (hidden // total_heads if hidden and total_heads else None)
    if not heads or not head_dim:
        raise DecoderIOError(f"cannot tell the KV heads/head_dim of '{kv.past}': the input declares no sizes "
                             "and config.json has none")
    return int(heads), int(head_dim)
