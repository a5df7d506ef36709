"""Batch jobs on Ray Data: the items become a dataset of one JSON string each, `map_batches` runs
them through a pool of actors that each make the job once (so each loads the model once), and the
driver receives the records as the batches finish (streaming execution), in completion order.

Every node must be able to import runnx and read the model folder and the audio files at the same
paths as the driver (a shared filesystem, or the same layout on each node). ray is imported here
only: runnx imports without it.
"""
from __future__ import annotations

import json
import math
import os

from runnx.batch.jobs import run_item
from runnx.errors import RunnxError

LOCAL = "local"


class BatchActor:
    """One Ray actor: the job made once, then `batch_size` items per call."""

    def __init__(self, job_factory, threads: int):
        # runnx's BLAS, numba and decode-pool threads: the actor's CPUs, unless the user chose
        os.environ.setdefault("RUNNX_THREADS", str(threads))
        self.job = job_factory()

    def __call__(self, batch: dict) -> dict:
        import numpy as np
        records = [run_item(self.job, json.loads(text)) for text in batch["item"]]
        return {"record": np.array([json.dumps(r, ensure_ascii=False) for r in records], dtype=object)}


def import_ray():
    try:
        import ray
        import ray.data
    except ImportError as error:
        raise RunnxError(f"--ray needs Ray Data: pip install 'runnx[ray]' (or 'ray[data]'); {error}") from None
    return ray


def ray_records(job_factory, items: list[dict], address: str, *, concurrency: int | None = None,
                batch_size: int = 4, cpus_per_worker: float = 1):
    """The records of `items` computed on the Ray cluster at `address` ("local": started here and
    shut down afterwards; when ray is already initialised, that cluster is used)."""
    if not items:
        return
    if batch_size < 1:
        raise RunnxError(f"--batch-size must be at least 1, got {batch_size}")
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=None if address == LOCAL else address, include_dashboard=False,
                 logging_level="WARNING")
    context = ray.data.DataContext.get_current()
    progress_bars, context.enable_progress_bars = context.enable_progress_bars, False  # a line per record instead
    try:
        cpus = ray.cluster_resources().get("CPU", 1)
        batches = math.ceil(len(items) / batch_size)
        actors = concurrency if concurrency is not None else max(1, int(cpus // cpus_per_worker))
        if actors < 1:
            raise RunnxError(f"--concurrency must be at least 1, got {concurrency}")
        dataset = ray.data.from_items([{"item": json.dumps(item, ensure_ascii=False)} for item in items],
                                      override_num_blocks=batches)  # a block per batch: actors share them out
        threads = max(1, math.ceil(cpus_per_worker))
        results = dataset.map_batches(BatchActor, fn_constructor_args=(job_factory, threads), batch_size=batch_size,
                                      compute=ray.data.ActorPoolStrategy(size=min(actors, batches)),
                                      num_cpus=cpus_per_worker, batch_format="numpy")
        try:
            for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
                for text in batch["record"]:
                    yield json.loads(text)
        except ray.exceptions.RayError as error:  # an actor that died, a lost node: resumable, say so
            raise RunnxError(f"the Ray job stopped: {' '.join(str(error).split())[:500]}; the records written so "
                             "far are kept: run the same command again to resume") from error
    finally:
        context.enable_progress_bars = progress_bars
        if started_here:
            ray.shutdown()
