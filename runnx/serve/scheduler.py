"""Continuous batching: one thread owns a language model's decoder and runs every decode step over
the rows of all requests in flight, so concurrent requests share each pass over the weights.

Between two steps the thread admits waiting requests and lets finished ones go:

- a new request's prompt is prefilled on its own (a second `DecoderStep` over the same loaded
  model, batch 1), its first token chosen, and its KV rows stacked into the batch cache,
  left-padded with a zero mask (kv_rows.py);
- a row that finished (stop token, stop string, max_tokens) or whose client went away
  (`Job.cancel`) is dropped by compacting the cache, and columns that became padding in every
  row are cut off.

Each row keeps its own sampler (a seeded `Multinomial` per request) and stop rules, and padding
does not change what the model computes for a row (positions come from the mask), so a request
gets the tokens it gets when served alone: its logits agree to rounding (padding and batch size
reorder float sums), which keeps greedy ids equal unless two candidates are that close. Results go
back through `Job.deliver`, called on this thread (the web side hands them to its event loop).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from runnx.generate.decoder import DecoderStep
from runnx.generate.generator import RowText
from runnx.generate.sampling import Multinomial, apply_processors, argmax, build_processors
from runnx.serve.kv_rows import keep_rows, stack_rows
from runnx.serve.schemas import Sampling

log = logging.getLogger("runnx.serve")

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class Piece:
    """Text generated since the last piece (held back while it could still become a stop string)."""

    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


class Job:
    """One request inside the scheduler. `sampling.max_tokens` must be set (the routes resolve it)."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling, deliver):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.sampling = sampling
        self.deliver = deliver  # deliver(event), called on the scheduler thread
        self.cancelled = False

    def cancel(self) -> None:
        """The client is gone: the row is dropped at the next step boundary."""
        self.cancelled = True


class _Row:
    """A request's decoding state: its processors and sampler, generated ids, text and stop rules."""

    def __init__(self, job: Job, tokenizer, generation_config: dict, stop_ids: frozenset[int]):
        self.job = job
        self.processors, self.sampler = decoding_rules(job.sampling, generation_config)
        self.stop_ids = stop_ids
        self.text = RowText(tokenizer, job.sampling.stop)
        self.generated: list[int] = []
        self.finish: str | None = None

    @property
    def next_token(self) -> int:
        return self.generated[-1]

    def choose(self, logits: np.ndarray) -> None:
        """Pick the next token from this row's logits [vocab], send the text it completes, and
        finish the row when a stop rule says so."""
        scores = logits[None].astype(np.float32)
        if self.processors:
            history = np.array([self.job.prompt_ids + self.generated], np.int64)
            scores = apply_processors(self.processors, history, scores)
        token = int(self.sampler(scores)[0])
        self.generated.append(token)
        if token in self.stop_ids:
            self.finish = FINISH_STOP
        else:
            self.text.put(token)
            if self.text.stopped:
                self.finish = FINISH_STOP
            elif len(self.generated) >= self.job.sampling.max_tokens:
                self.finish = FINISH_LENGTH
        if self.finish is not None:
            self.text.finish()
        piece = self.text.take(final=self.finish is not None)
        if piece:
            self.job.deliver(Piece(piece))
        if self.finish is not None:
            self.job.deliver(Finished(self.finish, len(self.job.prompt_ids), len(self.generated)))


def decoding_rules(sampling: Sampling, generation_config: dict) -> tuple[list, object]:
    """(logits processors, sampler) of one request: temperature 0 is greedy; settings not given
    take generation_config.json's (as `Generator` does), greedy unless it says do_sample."""
    temperature = sampling.temperature
    if temperature == 0:
        return [], argmax
    sample = temperature is not None or sampling.top_p is not None or bool(generation_config.get("do_sample"))
    if not sample:
        return [], argmax
    if temperature is None:
        temperature = generation_config.get("temperature")
    top_p = sampling.top_p if sampling.top_p is not None else generation_config.get("top_p")
    processors = build_processors(temperature=temperature, top_k=generation_config.get("top_k"), top_p=top_p)
    return processors, Multinomial(sampling.seed)


class BatchScheduler:
    """The decode loop of one language model (see the module docstring); `submit` is thread-safe."""

    def __init__(self, decoder: DecoderStep, prefill: DecoderStep, tokenizer, generation_config: dict, stop_ids, *,
                 max_batch: int = 16, name: str = "model"):
        """`decoder` runs the batch; `prefill` (over the same loaded models) runs new prompts."""
        self.decoder = decoder
        self.prefill = prefill
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.max_batch = max_batch
        self.rows: list[_Row] = []
        self.steps = 0  # batched decode steps run (tests read it to see that rows shared steps)
        self.widest = 0  # the most rows one step has run
        self._intake: queue.Queue = queue.Queue()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"runnx-serve-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._intake.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self._intake.put(job)

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def waiting(self) -> int:
        return self._intake.qsize()

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closing:
            jobs = self._take_jobs()
            try:
                self._admit(jobs)
                self._drop_finished()
                if self.rows:
                    self._step()
                    self._drop_finished()
            except Exception as error:  # a failed step must not take the server down: fail its rows
                log.exception("decode step failed")
                for row in self.rows:
                    row.job.deliver(Failed(f"generation failed: {error}"))
                for job in jobs:
                    if not any(row.job is job for row in self.rows):
                        job.deliver(Failed(f"generation failed: {error}"))
                self.rows = []
                self.decoder.reset(1)

    def _take_jobs(self) -> list[Job]:
        """Requests to admit now: block while idle; between steps take what waits, up to max_batch."""
        jobs = []
        if not self.rows:
            job = self._intake.get()
            if job is None:
                return []
            jobs.append(job)
        while len(self.rows) + len(jobs) < self.max_batch:
            try:
                job = self._intake.get_nowait()
            except queue.Empty:
                break
            if job is None:
                break
            jobs.append(job)
        return [job for job in jobs if not job.cancelled]

    def _admit(self, jobs: list[Job]) -> None:
        parts = []
        joined = []
        for job in jobs:
            row = _Row(job, self.tokenizer, self.generation_config, self.stop_ids)
            self.prefill.capacity = len(job.prompt_ids)
            self.prefill.reset(1)
            logits = self.prefill.step(np.array([job.prompt_ids], np.int64))[0, -1]
            row.choose(logits)
            if row.finish is None:
                parts.append((self.prefill.kv_arrays(), self.prefill.attention_mask))
                joined.append(row)
        if not joined:
            return
        if self.rows:
            parts.insert(0, (self.decoder.cache.arrays, self.decoder.attention_mask))
        arrays, mask = stack_rows(parts)
        self.decoder.restore(arrays, mask)
        self.rows.extend(joined)

    def _step(self) -> None:
        ids = np.array([[row.next_token] for row in self.rows], np.int64)
        logits = self.decoder.step(ids)[:, -1]
        self.steps += 1
        self.widest = max(self.widest, len(self.rows))
        for index, row in enumerate(self.rows):
            if not row.job.cancelled:
                row.choose(logits[index])

    def _drop_finished(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if row.finish is None and not row.job.cancelled]
        if len(keep) == len(self.rows):
            return
        if keep:
            arrays, mask = keep_rows(self.decoder.cache.arrays, self.decoder.attention_mask, keep)
            self.decoder.restore(arrays, mask)
        else:
            self.decoder.reset(1)
        self.rows = [self.rows[i] for i in keep]
