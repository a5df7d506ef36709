"""Batch jobs (runnx.batch): reading prompts files and audio lists, the resumable results file, the
batch forms of `runnx generate` / `runnx whisper`, and the same jobs on a local Ray cluster started
here (2 CPUs): results equal to the in-process run and to Generator.generate / Whisper.transcribe."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from runnx import cli
from runnx.batch.inputs import read_audio_list, read_prompts
from runnx.batch.jobs import GenerateJob, WhisperJob
from runnx.batch.results import ResultFile, read_results
from runnx.batch.runner import run_batch
from runnx.errors import BatchFileError, RunnxError
from runnx.generate.chat import Chat
from runnx.generate.generator import Generator

PROMPTS = [
    {"id": "fox", "prompt": "The quick brown fox"},
    {"id": "capital", "prompt": "The capital of France is", "max_new_tokens": 5},
    "A bare string is a prompt",
    {"id": "chat", "messages": [{"role": "user", "content": "Say hello."}]},
    {"id": 7, "prompt": "Numbers count", "stop": "\n"},
]


def write_lines(path, values) -> None:
    path.write_text("".join(json.dumps(v) + "\n" for v in values), encoding="utf-8")


def timeless(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "seconds"}


def without_timing(records: dict) -> dict:
    return {key: timeless(record) for key, record in records.items()}


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tiny_llama(fixtures_dir):
    return fixtures_dir / "tiny-llama"


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_lines(path, PROMPTS)
    return path


def test_runnx_imports_without_ray():
    code = "import sys, runnx, runnx.batch, runnx.cli; runnx.cli.build_parser(); print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


# ---------------------------------------------------------------------------------------------- inputs

def test_prompts_file_gives_items_with_ids_and_settings(prompts_file):
    items = read_prompts(prompts_file)
    assert [item["id"] for item in items] == ["fox", "capital", 3, "chat", 7]  # a line without id: its number
    assert items[1]["settings"] == {"max_new_tokens": 5}
    assert items[2]["prompt"] == "A bare string is a prompt"
    assert items[3]["messages"] == [{"role": "user", "content": "Say hello."}]
    assert items[4]["settings"] == {"stop": ["\n"]}


@pytest.mark.parametrize("line, message", [
    ('{"id": 1, "prompt": }', "prompts.jsonl:2: not valid JSON"),
    ('{"id": "a", "prompt": "again"}', "prompts.jsonl:2: id 'a' is already used at line 1"),
    ('{"prompt": "x", "max_tokens": 5}', "unknown key(s) max_tokens"),
    ('{"prompt": "x", "messages": []}', 'exactly one of "prompt"'),
    ('{"prompt": "x", "temperature": "hot"}', '"temperature" must be a number'),
    ('{"prompt": "x", "temperature": 0}', '"temperature" must be above 0, got 0'),
    ('{"id": [1], "prompt": "x"}', '"id" must be a string or an integer'),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_prompts_file_names_the_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(BatchFileError) as error:
        read_prompts(path)
    assert message in str(error.value)


def test_audio_list_skips_comments_and_resolves_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "files.txt").write_text("# speech\na.wav\n\n  sub/b.flac  \n", encoding="utf-8")
    items = read_audio_list("files.txt")
    assert items == [{"id": "a.wav", "path": str(tmp_path / "a.wav")},
                     {"id": "sub/b.flac", "path": str(tmp_path / "sub" / "b.flac")}]
    (tmp_path / "twice.txt").write_text("a.wav\na.wav\n", encoding="utf-8")
    with pytest.raises(BatchFileError, match="twice.txt:2: id 'a.wav' is already used at line 1"):
        read_audio_list("twice.txt")
    with pytest.raises(BatchFileError, match="input file not found"):
        read_audio_list("absent.txt")


# ---------------------------------------------------------------------------------------------- results file

def test_results_file_drops_errors_and_a_torn_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a", "text": "A"}\n{"id": "b", "error": "boom"}\n{"id": 3, "text": "C"}\n'
                    '{"id": "d", "te', encoding="utf-8")
    with ResultFile(path) as results:
        assert results.done == {"a", 3}
        assert results.dropped_errors == 1 and results.dropped_partial
        assert path.read_text() == '{"id": "a", "text": "A"}\n{"id": 3, "text": "C"}\n'  # repaired on open
        results.write({"id": "d", "text": "D"})
        results.write({"id": "b", "error": "again"})
        assert results.done == {"a", 3, "d"}
    assert list(read_results(path)) == ["a", 3, "d", "b"]


def test_results_file_keeps_a_complete_last_line_and_refuses_foreign_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a", "text": "A"}', encoding="utf-8")  # complete, but for its newline
    with ResultFile(path) as results:
        assert results.done == {"a"} and not results.dropped_partial
        results.write({"id": "b", "text": "B"})
    assert path.read_text().splitlines() == ['{"id": "a", "text": "A"}', '{"id": "b", "text": "B"}']
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(BatchFileError, match="results.jsonl:2: not a JSON object"):
        ResultFile(path)


def test_one_job_at_a_time_writes_a_results_file(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultFile(path) as first:
        first.write({"id": "a", "text": "A"})
        with pytest.raises(BatchFileError, match="is being written by another job"):
            ResultFile(path)
    with ResultFile(path) as again:  # released on close
        assert again.done == {"a"}


# ---------------------------------------------------------------------------------------------- in process

def expected_generation(generator, items, settings) -> dict:
    """What Generator.generate (and Chat.ask for "messages") give for each item, one by one."""
    texts = {}
    for item in items:
        options = {**settings, **{("stop_strings" if k == "stop" else k): (tuple(v) if k == "stop" else v)
                                  for k, v in item["settings"].items()}}
        if "messages" in item:
            texts[item["id"]] = Chat(generator).ask(item["messages"][0]["content"], **options)
        else:
            texts[item["id"]] = generator.generate(item["prompt"], **options)
    return texts


def test_generate_batch_equals_generator(capsys, tmp_path, tiny_llama, prompts_file):
    output = tmp_path / "results.jsonl"
    code, out, err = run_cli(capsys, "generate", tiny_llama, "--input", prompts_file, "--output", output,
                             "--max-new-tokens", 6)
    assert code == 0 and out == ""
    assert "[5/5]" in err and "5 done, 0 failed, 0 already in the results (of 5)" in err
    records = read_results(output)
    expected = expected_generation(Generator.from_folder(tiny_llama), read_prompts(prompts_file), {"max_new_tokens": 6})
    assert {key: record["text"] for key, record in records.items()} == expected
    assert records["capital"]["new_tokens"] <= 5 and records["fox"]["new_tokens"] <= 6
    assert all(record["prompt_tokens"] > 0 for record in records.values())


def test_generate_batch_chat_equals_runnx_generate_chat(capsys, tmp_path, tiny_llama):
    prompts = tmp_path / "prompts.jsonl"
    write_lines(prompts, [{"id": "q", "prompt": "Tell me about the fox."}])
    output = tmp_path / "results.jsonl"
    code, _, _ = run_cli(capsys, "generate", tiny_llama, "--input", prompts, "--output", output, "--chat",
                         "--system", "Be brief.", "--max-new-tokens", 8)
    assert code == 0
    code, single, _ = run_cli(capsys, "generate", tiny_llama, "Tell me about the fox.", "--chat",
                              "--system", "Be brief.", "--max-new-tokens", 8)
    assert code == 0
    assert read_results(output)["q"]["text"] + "\n" == single


class CountingJob:
    """A real job that records which items it ran."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        self.job = GenerateJob(*args, **kwargs)

    def __call__(self, item):
        CountingJob.calls.append(item["id"])
        return self.job(item)


def test_rerun_skips_what_is_done_and_each_id_appears_once(tmp_path, tiny_llama, prompts_file):
    output = tmp_path / "results.jsonl"
    items = read_prompts(prompts_file)
    # a crashed run: two finished, one failed, one cut short while being written
    output.write_text('{"id": "fox", "text": "KEPT"}\n{"id": 3, "text": "KEPT"}\n'
                      '{"id": "chat", "error": "was interrupted"}\n{"id": 7, "te', encoding="utf-8")
    CountingJob.calls = []
    job = functools.partial(CountingJob, tiny_llama, {"max_new_tokens": 4})
    summary = run_batch(job, items, output, progress=None)
    assert sorted(map(str, CountingJob.calls)) == ["7", "capital", "chat"]
    assert (summary.skipped, summary.done, summary.failed) == (2, 3, 0)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(str(record["id"]) for record in lines) == ["3", "7", "capital", "chat", "fox"]
    assert [r["text"] for r in lines if r["id"] in ("fox", 3)] == ["KEPT", "KEPT"]  # not redone
    CountingJob.calls = []
    again = run_batch(job, items, output, progress=None)
    assert CountingJob.calls == [] and again.skipped == 5


def test_bad_inputs_are_runnx_errors_before_any_work(capsys, tmp_path, tiny_llama):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "broken\n', encoding="utf-8")
    output = tmp_path / "results.jsonl"
    code, _, err = run_cli(capsys, "generate", tiny_llama, "--input", prompts, "--output", output)
    assert code == 2 and "prompts.jsonl:2: not valid JSON" in err
    assert not output.exists()
    code, _, err = run_cli(capsys, "generate", tiny_llama, "--input", prompts)
    assert code == 2 and "--input needs --output" in err
    code, _, err = run_cli(capsys, "generate", tiny_llama, "hello", "--output", output)
    assert code == 2 and "--output belong(s) to batch jobs" in err
    code, _, err = run_cli(capsys, "whisper", tiny_llama)
    assert code == 2 and "nothing to do" in err


def test_whisper_batch_writes_error_records_for_unreadable_audio(capsys, tmp_path, fixtures_dir):
    """A listed file that is missing (or does not decode) is the item's error record, not the job's
    end; the exit code says some failed and a rerun retries only those."""
    model = fixtures_dir / "tiny-whisper"
    (tmp_path / "noise.txt").write_text("not audio", encoding="utf-8")
    listing = tmp_path / "files.txt"
    listing.write_text(f"{tmp_path / 'absent.wav'}\n{tmp_path / 'noise.txt'}\n", encoding="utf-8")
    output = tmp_path / "results.jsonl"
    code, _, err = run_cli(capsys, "whisper", model, "--input-list", listing, "--output", output)
    assert code == 1 and "2 item(s) failed" in err
    records = read_results(output)
    assert "audio file not found" in records[str(tmp_path / "absent.wav")]["error"]
    assert "noise.txt" in records[str(tmp_path / "noise.txt")]["error"]
    code, _, err = run_cli(capsys, "whisper", model, "--input-list", listing, "--output", output)
    assert code == 1 and "retrying 2 failed item(s)" in err
    assert len(output.read_text().splitlines()) == 2  # each id once


def test_ray_missing_is_a_runnx_error(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as when it is not installed
    job = functools.partial(GenerateJob, str(tiny_llama))
    with pytest.raises(RunnxError, match=r"--ray needs Ray Data: pip install 'runnx\[ray\]'"):
        run_batch(job, [{"id": 1, "prompt": "x", "settings": {}}], tmp_path / "results.jsonl", ray_address="local")


# ---------------------------------------------------------------------------------------------- on Ray

@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with 2 CPUs for this module's Ray tests, shut down after them."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("ray")
    import ray
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             object_store_memory=200 * 1024 * 1024)
    yield ray
    ray.shutdown()


def run_both(factory, items, tmp_path, **ray_options) -> tuple[dict, dict, object]:
    """(records on Ray, records in process, the in-process job) of the same job and items."""
    on_ray, here = tmp_path / "ray.jsonl", tmp_path / "here.jsonl"
    summary = run_batch(factory, items, on_ray, ray_address="local", progress=None, **ray_options)
    assert summary.done + summary.failed == len(items)
    job = factory()
    run_batch(lambda: job, items, here, progress=None)
    return read_results(on_ray), read_results(here), job


def test_ray_generate_equals_in_process_and_generator(ray_cluster, tmp_path, smollm2_dir, prompts_file):
    items = read_prompts(prompts_file)
    settings = {"max_new_tokens": 8}
    factory = functools.partial(GenerateJob, str(smollm2_dir), settings)
    on_ray, here, job = run_both(factory, items, tmp_path, concurrency=2, batch_size=1)
    assert without_timing(on_ray) == without_timing(here)
    expected = expected_generation(job.generator, items, settings)
    assert {key: record["text"] for key, record in on_ray.items()} == expected
    assert "Paris" in on_ray["capital"]["text"]


def test_ray_whisper_equals_in_process_and_transcribe(ray_cluster, tmp_path, whisper_dir, audio_dir):
    clips = [audio_dir / name for name in ("john.wav", "fox.wav", "weather.wav")]
    listing = tmp_path / "files.txt"
    listing.write_text("".join(f"{clip}\n" for clip in clips) + f"{audio_dir / 'absent.wav'}\n", encoding="utf-8")
    items = read_audio_list(listing)
    on_ray, here, job = run_both(functools.partial(WhisperJob, str(whisper_dir)), items, tmp_path,
                                 concurrency=2, batch_size=1)
    assert without_timing(on_ray) == without_timing(here)
    for clip in clips:
        assert on_ray[str(clip)]["text"] == job.model.transcribe(str(clip)).text
        assert on_ray[str(clip)]["audio_seconds"] > 1
    expected = json.loads((audio_dir / "transcripts.json").read_text())
    assert on_ray[str(clips[0])]["text"] == expected["john.wav"]  # tiny.en hears this one word for word
    assert "audio file not found" in on_ray[str(audio_dir / "absent.wav")]["error"]


def test_cli_on_a_running_cluster_resumes(ray_cluster, tmp_path, tiny_llama, prompts_file):
    """`runnx generate --ray ADDRESS` in its own process joins this cluster, skips the records a
    crashed run left, and computes the rest as the in-process command does."""
    address = ray_cluster.get_runtime_context().gcs_address
    on_ray, here = tmp_path / "ray.jsonl", tmp_path / "here.jsonl"
    on_ray.write_text('{"id": "fox", "text": "KEPT"}\n{"id": "capital", "text": "KEPT"}\n{"id": "ch',
                      encoding="utf-8")
    command = [sys.executable, "-m", "runnx.cli", "generate", str(tiny_llama), "--input", str(prompts_file),
               "--max-new-tokens", "5"]
    done = subprocess.run([*command, "--output", str(on_ray), "--ray", address, "--batch-size", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "3 done, 0 failed, 2 already in the results (of 5)" in done.stderr
    assert cli.main([*command[3:], "--output", str(here)]) == 0
    lines = [json.loads(line) for line in on_ray.read_text().splitlines()]
    assert sorted(str(record["id"]) for record in lines) == ["3", "7", "capital", "chat", "fox"]
    assert [r["text"] for r in lines[:2]] == ["KEPT", "KEPT"]  # not redone
    expected = without_timing(read_results(here))
    assert all(timeless(r) == expected[r["id"]] for r in lines[2:])
