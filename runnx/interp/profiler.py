"""Profile of one or more runs: time per op type, in-place executions, counters, peak live bytes."""
from __future__ import annotations

from collections import defaultdict


class Profile:
    def __init__(self):
        self.op_time = defaultdict(float)  # op type -> seconds
        self.op_calls = defaultdict(int)
        self.inplace = defaultdict(int)  # op type -> executions that reused an input buffer
        self.moves = 0  # captured values moved (by value) into subgraphs
        self.counters = defaultdict(int)  # e.g. 'Concat.bytes_copied', 'Concat.appends_in_place'
        self.peak_live_bytes = 0
        self.runs = 0
        self.threads = None  # {'blas': n, 'numba': n} of the model that ran

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    @property
    def inplace_total(self) -> int:
        return sum(self.inplace.values())

    def summary(self, top: int = 25) -> str:
        total = sum(self.op_time.values()) or 1e-12
        lines = [f"runnx profile: {self.runs} run(s), {sum(self.op_calls.values())} node executions, "
                 f"{self.inplace_total} in place, {self.moves} captures moved, "
                 f"peak live {self.peak_live_bytes / 2**20:.1f} MiB"
                 + (f", threads: BLAS {self.threads['blas']}, numba {self.threads['numba']}, decode pool "
                    f"{self.threads['decode']}" if self.threads else ""),
                 f"{'op':<24}{'calls':>8}{'in place':>10}{'ms':>10}{'%':>7}"]
        for op, seconds in sorted(self.op_time.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"{op:<24}{self.op_calls[op]:>8}{self.inplace[op]:>10}{seconds * 1e3:>10.2f}"
                         f"{100 * seconds / total:>7.1f}")
        for name, value in sorted(self.counters.items()):
            lines.append(f"{name}: {value}")
        return "\n".join(lines)
