"""Batch jobs: many prompts or recordings through one model, in-process or on a Ray cluster.

    runnx generate MODEL_DIR --input prompts.jsonl --output results.jsonl [--ray [ADDRESS]]
    runnx whisper MODEL_DIR --input-list files.txt --output results.jsonl [--ray [ADDRESS]]

Modules: `inputs` (reading prompts.jsonl and audio lists into items with unique ids), `results`
(the resumable results.jsonl), `jobs` (the work on one item, loading the model once), `runner`
(the driver both paths share: skip what is done, write records as they come, report progress),
`ray_driver` (the same jobs as Ray Data actors; ray is imported only there, when a job runs),
`cli` (the options). Importing runnx.batch loads no model and no ray.
"""
from __future__ import annotations

from runnx.batch.inputs import read_audio_list, read_prompts
from runnx.batch.jobs import GenerateJob, WhisperJob
from runnx.batch.results import ResultFile, read_results
from runnx.batch.runner import BatchSummary, run_batch

__all__ = ["BatchSummary", "GenerateJob", "ResultFile", "WhisperJob", "read_audio_list", "read_prompts",
           "read_results", "run_batch"]
