"""The one code generator: a run of kernel calls as one straight-line Python function.

Plans (compiled.py) and memo groups (shape_cache.py) run as generated functions, where looping
over steps, gathering each one's inputs into a list and storing its outputs would cost as much as
small kernels do. Values are locals; kernels, attribute dicts and constants are globals; each node
is the few lines its caller emits around the kernel's call. This module owns what both share:
naming globals, calling a kernel with its attributes bound as defaults of a copy of it
(`registry.bound_kernel`: matching two dozen keyword arguments costs microseconds a call),
compiling under a name saying what was generated, and naming a failing node. A failure is placed
at its node by the line it was raised on, so the nodes carry no bookkeeping for errors, and is
worded by `node_error`, as the interpreted loop words it.

CPython's `compile()` costs microseconds per syntax node, paid by the run that generates the
function: the callers emit a node's common path inline and call shared helpers for the rest. What
a plan emits for storage ownership comes from the rules themselves (capture/ownership.py), what
it emits to find a memo's kept result from its ShapeGroup.

The bytecode is also kept on disk, as Python keeps a module's (`generated_code_root`, one file
named by a hash of the source, its name and the interpreter's bytecode version): the same model's
plan and memos in a later process are read back, not compiled again (a few dozen milliseconds of a
first token). The source is generated from the graph alone, so it is the same in every process; a
file that cannot be read or written is compiled as if absent.
"""
from __future__ import annotations

import hashlib
import marshal
import os
from bisect import bisect_right
from importlib.util import MAGIC_NUMBER

from runnx._cache_dirs import generated_code_root
from runnx.interp.node_context import node_error
from runnx.ops.registry import bound_kernel

INDENT = "        "  # of a node's lines: inside the function's `try`


class Program:
    """The source of one generated function `run(<parameters>)` and the globals it reads."""

    def __init__(self, graph, parameters: str, title: str, prologue: list[str] = ()):
        """`prologue`: lines run before the first node (outside the failure handling)."""
        self.graph = graph
        self.title = title
        self.namespace: dict = {}
        self.head = [f"def run({parameters}):", *(f"    {line}" for line in prologue), "    try:"]
        self.body: list[str] = []  # the nodes' lines, indented when built
        self._starts: list[int] = []  # the first line of each node's code
        self._nodes: list = []
        self._arguments: list[list[str]] = []

    def set(self, name: str, value) -> str:
        """`name`, a global of the function holding `value`."""
        self.namespace[name] = value
        return name

    def node(self, node, arguments: list[str]) -> None:
        """Begin the lines of `node`, whose inputs are the locals or globals named `arguments`
        ("None" for an omitted one): a failure from here to the next node's lines is its."""
        self._starts.append(len(self.head) + len(self.body) + 1)
        self._nodes.append(node)
        self._arguments.append(arguments)
        self.body.append(f"# {node.describe()}")

    def emit(self, *lines: str) -> None:
        """Lines of the current node (nested blocks indent their own)."""
        self.body += lines

    def call(self, index: int, fn, attributes: dict, arguments: list[str], ctx: bool = False) -> str:
        """The expression calling kernel `fn` of the `index`-th node on `arguments` with `attributes`
        (bound as its defaults where it takes them keyword-only, else passed as a global dict),
        and the run's context when the kernel wants it."""
        kernel, attributes = bound_kernel(fn, attributes)
        arguments = list(arguments)
        if attributes:
            arguments.append(f"**{self.set(f'kw{index}', attributes)}")
        if ctx:
            arguments.append("ctx=ctx")
        return f"{self.set(f'f{index}', kernel)}({', '.join(arguments)})"

    def build(self, returns: str):
        """The function: compiled, its failures named by their node; `returns`, its result."""
        tail = ["        pass",
                "    except Exception as error:",
                "        wrapped = FAILED(error, locals())",
                "        if wrapped is error:",
                "            raise",
                "        raise wrapped from error",
                f"    return {returns}"]
        source = "\n".join(self.head) + f"\n{INDENT}" + f"\n{INDENT}".join(self.body) + "\n" + "\n".join(tail)
        self.head = self.body = None  # the source is not kept: a plan's is megabytes
        self.namespace["FAILED"] = self._failed
        exec(compiled(source, f"<runnx {self.title}>"), self.namespace)
        return self.namespace["run"]

    def _failed(self, error: Exception, scope: dict) -> Exception:
        """The error to raise for `error`, caught in the generated function with locals `scope`:
        `node_error`'s, naming the node whose lines it was raised on and the inputs it was given."""
        at = bisect_right(self._starts, error.__traceback__.tb_lineno) - 1
        args = [scope[name] if name in scope else self.namespace.get(name) for name in self._arguments[at]]
        return node_error(self.graph, self._nodes[at], args, error)


def compiled(source: str, filename: str):
    """compile(source, filename, "exec"), read from the bytecode kept on disk by an earlier process
    when there is one (module docstring), else compiled and kept."""
    key = hashlib.sha256(MAGIC_NUMBER + filename.encode() + b"\0" + source.encode()).hexdigest()
    path = generated_code_root() / key[:2] / key
    try:
        return marshal.loads(path.read_bytes())
    except (OSError, EOFError, ValueError, TypeError):  # absent, unreadable or cut short
        pass
    code = compile(source, filename, "exec")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{key}.{os.getpid()}.tmp")
        partial.write_bytes(marshal.dumps(code))
        os.replace(partial, path)  # whole or not at all: another process may be reading it
    except OSError:
        pass
    return code
