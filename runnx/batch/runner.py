"""The driver of a batch job, one code path for both engines: open the results file, skip the items
it already has, get records from the engine (in this process, or Ray actors), append each as it
comes and report it on a progress line."""
from __future__ import annotations

import time
from dataclasses import dataclass

from runnx.batch.jobs import run_item
from runnx.batch.results import ResultFile


@dataclass
class BatchSummary:
    total: int  # items in the input
    skipped: int  # already in the results file
    done: int  # run now, successfully
    failed: int  # run now, written as error records (a rerun retries them)
    seconds: float

    def describe(self) -> str:
        rate = (self.done + self.failed) / self.seconds if self.seconds > 0 else 0.0
        return (f"{self.done} done, {self.failed} failed, {self.skipped} already in the results "
                f"(of {self.total}); {self.seconds:.1f} s, {rate:.2f} items/s")


def in_process_records(job_factory, items: list[dict]):
    """The records of `items`, computed here by one job (its model loaded once)."""
    if not items:
        return
    job = job_factory()
    for item in items:
        yield run_item(job, item)


def run_batch(job_factory, items: list[dict], output, *, ray_address: str | None = None,
              concurrency: int | None = None, batch_size: int = 4, cpus_per_worker: float = 1,
              progress=None) -> BatchSummary:
    """Run `job_factory()`'s job over the items not yet in `output`: in this process, or on Ray when
    `ray_address` is given ("local": a cluster started for this job; "auto" or "ray://host:10001":
    a running one) with `concurrency` actors of `cpus_per_worker` CPUs, `batch_size` items per task.
    `progress`: a text stream for a line per record (the CLI gives stderr)."""
    started = time.perf_counter()
    with ResultFile(output) as results:
        if results.dropped_errors or results.dropped_partial:
            _say(progress, f"{output}: retrying {results.dropped_errors} failed item(s)"
                           + ("; dropped a last line cut short" if results.dropped_partial else ""))
        pending = [item for item in items if item["id"] not in results.done]
        skipped = len(items) - len(pending)
        if skipped:
            _say(progress, f"{output}: {skipped} of {len(items)} item(s) already done, skipped")
        if ray_address is None:
            records = in_process_records(job_factory, pending)
        else:
            from runnx.batch.ray_driver import ray_records
            records = ray_records(job_factory, pending, ray_address, concurrency=concurrency,
                                  batch_size=batch_size, cpus_per_worker=cpus_per_worker)
        done = failed = 0
        for record in records:
            results.write(record)
            failed += "error" in record
            done += "error" not in record
            outcome = f"error: {record['error']}" if "error" in record else f"{record['seconds']:.2f} s"
            _say(progress, f"[{done + failed}/{len(pending)}] {record['id']}: {outcome}")
    return BatchSummary(len(items), skipped, done, failed, time.perf_counter() - started)


def _say(stream, line: str) -> None:
    if stream is not None:
        print(line, file=stream, flush=True)
