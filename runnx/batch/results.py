"""results.jsonl: one JSON object per line, appended and flushed record by record, so a job that
stops (a crash, Ctrl-C, a lost node) keeps everything finished and a rerun skips it.

Opening the file reads what is there: records with an "error" are dropped so that the rerun
retries them, and so is a last line cut short by a crash (it has no newline and does not parse);
when anything is dropped the file is rewritten without it (to a temporary file, then renamed).
Any other line that is not a JSON object with an "id" is a BatchFileError: the file is not ours.
One job at a time writes a results file: it holds an exclusive lock on `results.jsonl.lock` (kept
beside it) while open, so a second job on the same file stops at once instead of redoing the work.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from runnx.errors import BatchFileError


class ResultFile:
    """Append-only results; `done` holds the ids of the records that succeeded."""

    def __init__(self, path):
        self.path = Path(path)
        self.done: set = set()
        self.dropped_errors = 0
        self.dropped_partial = False  # a last line cut short by a crash
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        try:
            kept, clean = self._read_existing()
            if not clean:
                self._rewrite(kept)
            self._file = open(self.path, "a", encoding="utf-8")
        except BaseException:
            self._lock.close()
            raise

    def _take_lock(self):
        lock = open(self.path.with_name(self.path.name + ".lock"), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise BatchFileError(f"{self.path} is being written by another job (it holds {lock.name}); "
                                 "wait for it, or give another --output") from None
        return lock

    def _read_existing(self) -> tuple[list[str], bool]:
        """(the lines to keep, whether the file is exactly those lines)."""
        if not self.path.exists():
            return [], True
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise BatchFileError(f"cannot read the results file {self.path}: {error}") from None
        lines = text.split("\n")
        torn = lines.pop()  # "" when the file ends with a newline
        kept = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = _record(line)
            if record is None:
                raise BatchFileError(f"{self.path}:{number}: not a JSON object with an \"id\"; a results file "
                                     "holds one record per line (is this the right --output?)")
            if "error" in record:
                self.dropped_errors += 1
                continue
            self.done.add(record["id"])
            kept.append(line)
        record = _record(torn) if torn.strip() else None
        if torn.strip() and record is None:
            self.dropped_partial = True
        elif record is not None and "error" in record:
            self.dropped_errors += 1
        elif record is not None:  # complete but for its newline: kept, and the newline added
            self.done.add(record["id"])
            kept.append(torn)
        return kept, not (self.dropped_errors or torn)

    def _rewrite(self, lines: list[str]) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(temporary, self.path)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        if "error" not in record:
            self.done.add(record["id"])

    def close(self) -> None:
        self._file.close()
        self._lock.close()  # releases the lock

    def __enter__(self) -> "ResultFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "id" in record else None


def read_results(path) -> dict:
    """{id: record} of a results file (the last record of an id wins)."""
    records = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        record = _record(line)
        if record is not None:
            records[record["id"]] = record
    return records
