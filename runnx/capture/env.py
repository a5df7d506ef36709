"""CaptureEnv: how a subgraph (If/Loop/Scan body) receives the outer values it reads.

A captured value is passed by value (moved: the subgraph owns it and may consume it in place)
when the parent owns it and the subgraph node is its last use; otherwise by reference
(read-only). Loop/Scan iterations use `env.child()`, which lends every capture read-only:
captures are never copied per iteration.
"""
from __future__ import annotations


class CaptureEnv:
    __slots__ = ("values", "owned")

    def __init__(self, values: dict, owned: dict):
        self.values = values  # name -> value
        self.owned = owned  # name -> True when moved in (by value)

    def take(self, name: str):
        """(value, owned) for a capture; an owned capture leaves the env (it can be moved once)."""
        value = self.values[name]
        if self.owned.get(name):
            del self.owned[name]
            del self.values[name]
            return value, True
        return value, False

    def child(self) -> "CaptureEnv":
        """The env for one loop iteration: same values, all lent read-only."""
        return CaptureEnv(self.values, {})

    def moved(self) -> list[str]:
        return sorted(self.owned)


class Subgraph:
    """A graph attribute (If branch, Loop/Scan body) bound to its CaptureEnv for one node run.

    Kernels annotate such attributes as `Subgraph` and call `run` (once, may consume by-value
    captures) or `iterate` (per loop iteration, captures read-only). Both take the formal inputs
    and their owned flags and return (outputs, owned flags).
    """

    __slots__ = ("graph", "env", "_runner")

    def __init__(self, graph, env: CaptureEnv, runner):
        self.graph = graph
        self.env = env
        self._runner = runner

    @property
    def input_names(self) -> list[str]:
        return [self.graph.names[i] for i in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [self.graph.names[i] for i in self.graph.outputs]

    @property
    def input_info(self):
        return self.graph.input_info

    @property
    def output_info(self):
        return self.graph.output_info

    def run(self, inputs=(), owned=None):
        return self._runner(self.graph, self.env, list(inputs), owned)

    def iterate(self, inputs=(), owned=None):
        return self._runner(self.graph, self.env.child(), list(inputs), owned)

    def __call__(self, *inputs):
        """Run once with borrowed inputs; just the output values."""
        return self.run(inputs)[0]
