"""Whether the process's models are quiet: no run, load or prepack under way, and none for a while.

A chore that competes with them for the cores waits for such a moment (`wait_quiet`): settling
weights into huge pages (`model_file.settle`), which on a virtual machine whose host backs each
new huge page slowly holds a core for seconds. Runs, loads and prepacks mark themselves `BUSY`,
and so do a decoder's steps and a transcription from their start (their first allocations wait
for a collapse under way); a decode loop's steps follow each other within a millisecond, a server's
requests and a chat's turns leave gaps, and the chore takes those.
"""
from __future__ import annotations

import threading
import time


class _Busy:
    """A context (reentrant, any thread) during which the models are not quiet; leaving it restarts
    the quiet time."""

    __slots__ = ("_lock", "count", "ended")

    def __init__(self):
        self._lock = threading.Lock()
        self.count = 0  # busy blocks open now
        self.ended = time.monotonic()  # when the last one ended (the process's start: this import)

    def __enter__(self):
        with self._lock:
            self.count += 1

    def __exit__(self, *_):
        with self._lock:
            self.count -= 1
            self.ended = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the last busy block ended, 0.0 while one is open."""
        with self._lock:
            return 0.0 if self.count else time.monotonic() - self.ended


BUSY = _Busy()


def wait_quiet(seconds: float) -> None:
    """Return once nothing has been busy for `seconds` (at once when that holds already)."""
    while (left := seconds - BUSY.quiet_for()) > 0:
        time.sleep(left)
