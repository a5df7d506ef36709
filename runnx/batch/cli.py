"""The batch options of `runnx generate` and `runnx whisper`, and the commands they run.

    runnx generate MODEL_DIR --input prompts.jsonl --output results.jsonl [--ray [ADDRESS]] [decoding options]
    runnx whisper MODEL_DIR --input-list files.txt --output results.jsonl [--ray [ADDRESS]] [--timestamps]

Exit code 0 when every item is in the results, 1 when some failed (their error records are
retried by the next run), 2 for a runnx error (a malformed input file, a model that does not load).
"""
from __future__ import annotations

import functools
import sys

EXIT_SOME_FAILED = 1


def add_batch_arguments(parser, input_flag: str, input_help: str) -> None:
    group = parser.add_argument_group("batch jobs (resumable; on a Ray cluster with --ray)")
    group.add_argument(input_flag, dest="batch_input", metavar="FILE", help=input_help)
    group.add_argument("--output", metavar="RESULTS.jsonl",
                       help="results, one JSON object per line, appended as they finish; a rerun skips the ids "
                            "already there and retries the failed ones")
    group.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                       help="run on Ray: alone, a local cluster started for the job; or a running cluster's "
                            "address (auto, ray://HOST:10001)")
    group.add_argument("--concurrency", type=int, metavar="N",
                       help="with --ray: model actors (default: the cluster's CPUs / --cpus-per-worker)")
    group.add_argument("--cpus-per-worker", type=float, default=1, metavar="C",
                       help="with --ray: CPUs (and runnx threads) per actor, default 1")
    group.add_argument("--batch-size", type=int, default=4, metavar="B",
                       help="with --ray: items per actor call, default 4")


def batch_requested(args, single_inputs, input_flag: str) -> bool:
    """True for a batch job; a CliError for a mix of the two ways, or neither."""
    from runnx.cli import CliError
    if args.batch_input is None:
        extra = [flag for flag, value in (("--output", args.output), ("--ray", args.ray)) if value is not None]
        if extra:
            raise CliError(f"{', '.join(extra)} belong(s) to batch jobs: give {input_flag} FILE too")
        if not single_inputs:
            raise CliError(f"nothing to do: give an input on the command line, or {input_flag} FILE --output "
                           "RESULTS.jsonl")
        return False
    if single_inputs:
        raise CliError(f"give inputs either on the command line or with {input_flag}, not both")
    if args.output is None:
        raise CliError(f"{input_flag} needs --output RESULTS.jsonl")
    return True


def run_generate_batch(args, settings: dict) -> int:
    from runnx.batch.inputs import read_prompts
    from runnx.batch.jobs import GenerateJob
    items = read_prompts(args.batch_input)
    job = functools.partial(GenerateJob, str(args.model_dir), settings, chat=args.chat, system=args.system,
                            variant=args.variant)
    return _run(job, items, args)


def run_whisper_batch(args, timestamps: bool | None) -> int:
    from runnx.batch.inputs import read_audio_list
    from runnx.batch.jobs import WhisperJob
    from runnx.cli import CliError
    if args.format != "txt":
        raise CliError("batch results are JSON records (as --format json prints them): --format applies to "
                       "files given on the command line")
    items = read_audio_list(args.batch_input)
    job = functools.partial(WhisperJob, str(args.model_dir), language=args.language, task=args.task,
                            timestamps=timestamps, variant=args.variant)
    return _run(job, items, args)


def _run(job, items: list[dict], args) -> int:
    from runnx.batch.runner import run_batch
    from runnx.cli import CliError
    if args.concurrency is not None and args.concurrency < 1:
        raise CliError("--concurrency must be at least 1")
    if args.batch_size < 1 or args.cpus_per_worker <= 0:
        raise CliError("--batch-size must be at least 1 and --cpus-per-worker above 0")
    summary = run_batch(job, items, args.output, ray_address=args.ray, concurrency=args.concurrency,
                        batch_size=args.batch_size, cpus_per_worker=args.cpus_per_worker, progress=sys.stderr)
    print(summary.describe(), file=sys.stderr)
    if summary.failed:
        print(f"runnx: {summary.failed} item(s) failed: their records in {args.output} have an \"error\"; "
              "run the command again to retry them", file=sys.stderr)
        return EXIT_SOME_FAILED
    return 0
