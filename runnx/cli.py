"""The `runnx` command: run and inspect ONNX models from the shell.

    runnx run MODEL [-i NAME=FILE ...] [--dim NAME=N ...] [-n ITERS] [--profile] [--output NAME ...] [--save OUT.npz]
    runnx inspect MODEL [--plan]

Subcommands are plug-ins with one contract: a module with `register(subparsers)` that adds its
parser and sets `func=` (called with the parsed arguments; returns an exit code or None). The
built-in ones follow it too; the modules in PLUGINS are imported when present, so other parts of
runnx add subcommands (generate, chat, whisper) without editing this file.
Errors runnx raises on purpose (RunnxError) print as one line and exit with code 2.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

PLUGINS = ("runnx.generate.cli", "runnx.generate.whisper_cli", "runnx.serve.cli")
EXIT_ERROR = 2


class CliError(Exception):
    """A bad command line or input file; printed like a RunnxError."""


# ---------------------------------------------------------------------------------------------- inputs

def parse_assignment(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.rpartition("=")
    if not sep or not name or not value:
        raise CliError(f"{what} must look like NAME=VALUE, got '{text}'")
    return name, value


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Arrays of a .npy (one, named after the file), .npz or .safetensors file."""
    if not path.is_file():
        raise CliError(f"input file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            return {path.stem: np.load(path, allow_pickle=False)}
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
        if suffix == ".safetensors":
            from safetensors.numpy import load_file
            return load_file(str(path))
    except (OSError, ValueError) as error:
        raise CliError(f"cannot read {path}: {error}") from None
    raise CliError(f"{path}: input files must be .npy, .npz or .safetensors")


def given_inputs(specs: list[str]) -> dict[str, np.ndarray]:
    """-i NAME=FILE feeds one input (a .npz/.safetensors file must hold NAME or a single array);
    -i FILE.npz (or .safetensors) feeds every array of the file under its own name."""
    feeds = {}
    for spec in specs:
        if "=" not in spec:
            feeds.update(read_arrays(Path(spec)))
            continue
        name, file = parse_assignment(spec, "-i")
        arrays = read_arrays(Path(file))
        if name in arrays:
            feeds[name] = arrays[name]
        elif len(arrays) == 1:
            feeds[name] = next(iter(arrays.values()))
        else:
            raise CliError(f"{file} holds {', '.join(sorted(arrays))}: none is named '{name}'")
    return feeds


def parse_dims(specs: list[str]) -> dict[str, int]:
    dims = {}
    for spec in specs:
        name, value = parse_assignment(spec, "--dim")
        try:
            dims[name] = int(value)
        except ValueError:
            raise CliError(f"--dim {name}: '{value}' is not an integer") from None
        if dims[name] < 0:
            raise CliError(f"--dim {name}: must be >= 0")
    return dims


def dim_value(dim, dims: dict[str, int]) -> int:
    """The size to use for one declared dimension: a number, a --dim symbol (default 1), or an
    expression of symbols as exporters write them ('past_sequence_length + sequence_length')."""
    if isinstance(dim, int) and dim >= 0:
        return dim
    if not isinstance(dim, str):
        return 1
    if dim in dims:
        return dims[dim]
    try:
        return _evaluate(ast.parse(dim, mode="eval").body, dims)
    except (SyntaxError, ValueError):
        return 1


_OPERATORS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}


def _evaluate(node, dims: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return dims.get(node.id, 1)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, dims), _evaluate(node.right, dims))
    raise ValueError(f"not a dimension expression: {ast.dump(node)}")


def generated_input(info, dims: dict[str, int], rng: np.random.Generator):
    """(value, how) for an input nobody gave: ids -> zeros, masks -> ones, floats random normal,
    anything else zeros."""
    from runnx.interp.dtypes import ONNX_TO_NUMPY
    if info.kind == "sequence":
        return [], "empty sequence"
    if info.kind == "optional":
        return None, "empty optional"
    dtype = ONNX_TO_NUMPY.get(info.elem_type)
    if dtype is None:
        raise CliError(f"input '{info.name}' has element type {info.elem_type}: give it with -i")
    shape = tuple(dim_value(dim, dims) for dim in (info.shape or ()))
    name = info.name.lower()
    if "mask" in name:
        return np.ones(shape, dtype), "ones"
    if (dtype.kind == "f" or "float" in dtype.name) and "ids" not in name:  # ml_dtypes floats have kind 'V'
        return rng.standard_normal(shape).astype(dtype), "random normal"
    if dtype.kind == "O":
        return np.full(shape, "", dtype=object), "empty strings"
    return np.zeros(shape, dtype), "zeros"


def given_dims(model, given: dict) -> dict[str, int]:
    """Sizes of the symbolic dimensions that the given feeds fix."""
    sizes = {}
    for info in model.inputs:
        value = given.get(info.name)
        if isinstance(value, np.ndarray) and info.shape is not None and len(info.shape) == value.ndim:
            sizes.update((dim, size) for dim, size in zip(info.shape, value.shape) if isinstance(dim, str))
    return sizes


def complete_feeds(model, given: dict, dims: dict[str, int], seed: int) -> dict:
    """The given feeds (runnx checks their names, dtypes and shapes) plus generated ones for the rest,
    whose symbolic dimensions follow --dim, else the given feeds' sizes, else 1."""
    dims = {**given_dims(model, given), **dims}
    rng = np.random.default_rng(seed)
    feeds = dict(given)
    for info in model.inputs:
        if info.name in feeds:
            continue
        value, how = generated_input(info, dims, rng)
        feeds[info.name] = value
        note = f"{how}, seed {seed}" if how == "random normal" else how
        print(f"note: generated input {info.name} {describe(value)} ({note})")
    return feeds


# ---------------------------------------------------------------------------------------------- output

def describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}[{', '.join(map(str, value.shape))}]"
    if isinstance(value, list):
        return f"sequence of {len(value)}"
    return "none" if value is None else type(value).__name__


def summary(value) -> str:
    if not isinstance(value, np.ndarray) or value.size == 0:
        return ""
    if value.dtype == np.bool_:
        return f"true {int(value.sum())} of {value.size}"
    if value.dtype.kind not in "iufc" and "float" not in value.dtype.name:
        return ""
    data = value.astype(np.float64) if value.dtype.kind != "c" else np.abs(value)
    finite = data[np.isfinite(data)]
    text = (f"min {finite.min():.6g}  max {finite.max():.6g}  mean {finite.mean():.6g}" if finite.size
            else "no finite values")
    if finite.size != data.size:
        text += f"  non-finite {data.size - finite.size}"
    return text


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


# ---------------------------------------------------------------------------------------------- run

def command_run(args) -> int:
    import runnx
    given = given_inputs(args.input)
    dims = parse_dims(args.dim)
    if args.iterations < 1:
        raise CliError("-n must be at least 1")
    start = time.perf_counter()
    model = runnx.load(args.model)
    print(f"loaded {args.model} in {milliseconds(time.perf_counter() - start)}")
    feeds = complete_feeds(model, given, dims, args.seed)
    profile = runnx.Profile() if args.profile else False
    times = []
    for _ in range(args.iterations):
        start = time.perf_counter()
        outputs = model.run(feeds, args.output or None, profile=profile)
        times.append(time.perf_counter() - start)
    width = max((len(name) for name in outputs), default=0)
    for name, value in outputs.items():
        print(f"  {name:<{width}}  {describe(value):<24} {summary(value)}")
    if len(times) == 1:
        print(f"time: {milliseconds(times[0])} (1 iteration)")
    else:
        print(f"time per iteration: mean {milliseconds(sum(times) / len(times))}, min {milliseconds(min(times))}, "
              f"max {milliseconds(max(times))} ({len(times)} iterations)")
    if args.profile:
        print(profile.summary())
    if args.save:
        arrays = {name: value for name, value in outputs.items() if isinstance(value, np.ndarray)}
        np.savez(args.save, **arrays)
        print(f"saved {len(arrays)} output(s) to {args.save}")
    return 0


def run_compile_key(args) -> list:
    """What chooses the kernels `runnx run` calls (`runnx/background_compile.py`): the model and
    the inputs' files and dimensions."""
    return ["run", os.path.abspath(args.model), args.input, args.dim, args.output]


def run_compile_argv(args) -> list[str]:
    """The run that compiles them: one iteration, no profile, nothing saved."""
    argv = ["run", args.model, "--seed", str(args.seed)]
    for spec in args.input:
        argv += ["-i", spec]
    for spec in args.dim:
        argv += ["--dim", spec]
    return argv + (["--output", *args.output] if args.output else [])


# ---------------------------------------------------------------------------------------------- inspect

def shape_text(value_info) -> str:
    import onnx
    if not value_info.type.HasField("tensor_type"):  # sequence, optional, map: name the kind
        return value_info.type.WhichOneof("value") or "unknown"
    tensor = value_info.type.tensor_type
    element = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
    if not tensor.HasField("shape"):
        return f"{element}[?]"
    dims = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in tensor.shape.dim]
    return f"{element}[{', '.join(dims)}]"


def walk_graphs(graph):
    """The graph and all its subgraphs (If branches, Loop/Scan bodies), depth first."""
    import onnx
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from walk_graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from walk_graphs(subgraph)


def op_key(node) -> tuple[str, str]:
    return (node.domain if node.domain not in ("", "ai.onnx") else "", node.op_type)


def op_label(key: tuple[str, str]) -> str:
    return f"{key[0]}::{key[1]}" if key[0] else key[1]


def command_inspect(args) -> int:
    import onnx

    from runnx.ops import registry
    path = Path(args.model)
    if not path.is_file():
        raise CliError(f"model file not found: {path}")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # protobuf raises its own DecodeError; say it in one line
        raise CliError(f"cannot parse {path} as an ONNX model: {error}") from None
    graph = proto.graph
    opsets = {(entry.domain or "ai.onnx"): entry.version for entry in proto.opset_import}
    print(f"model: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    producer = f"{proto.producer_name} {proto.producer_version}".strip() or "unknown"
    print(f"ir_version {proto.ir_version}, producer {producer}")
    print("opsets: " + ", ".join(f"{domain} {version}" for domain, version in sorted(opsets.items())))
    initializer_names = {init.name for init in graph.initializer}
    print("inputs:")
    for value_info in graph.input:
        default = "  (has a default: initializer)" if value_info.name in initializer_names else ""
        print(f"  {value_info.name}: {shape_text(value_info)}{default}")
    print("outputs:")
    for value_info in graph.output:
        print(f"  {value_info.name}: {shape_text(value_info)}")
    graphs = list(walk_graphs(graph))
    initializers = [init for subgraph in graphs for init in subgraph.initializer]
    parameters = sum(int(np.prod(init.dims, dtype=np.int64)) for init in initializers)
    print(f"parameters: {parameters:,} in {len(initializers)} initializers")

    nodes = [node for subgraph in graphs for node in subgraph.node]
    histogram = Counter(op_key(node) for node in nodes)
    print(f"nodes: {len(graph.node)} in the main graph, {len(nodes)} including subgraphs; "
          f"{len(histogram)} op types:")
    for key, count in sorted(histogram.items(), key=lambda item: (-item[1], op_label(item[0]))):
        print(f"  {op_label(key):<28}{count:>7}")
    functions = {(function.domain, function.name) for function in proto.functions}
    unsupported = []
    for key, count in sorted(histogram.items()):
        domain, op_type = key
        if (domain, op_type) in functions:
            continue
        opset = opsets.get(domain or "ai.onnx")
        if opset is None or registry.resolve(domain, op_type, opset) is None:
            versions = registry.known_versions(domain, op_type)
            known = f"runnx has since-versions {versions}" if versions else "runnx has no kernel"
            unsupported.append(f"  {op_label(key)} at opset {opset}: {count} node(s); {known}")
    if unsupported:
        print(f"unsupported ops ({len(unsupported)}):")
        print("\n".join(unsupported))
    else:
        print("unsupported ops: none")
    if args.plan:
        print_plan(path)
    return 0


def print_plan(path: Path) -> None:
    import runnx
    model = runnx.load(path)
    nodes = model.plan()
    names = model.graph.names
    print(f"plan ({len(nodes)} nodes, in execution order):")
    for step, node in enumerate(nodes):
        inputs = ", ".join(names[vid] if vid >= 0 else "" for vid in node.inputs)
        outputs = ", ".join(names[vid] for vid in node.outputs)
        print(f"  {step:>5}  {node.op_type:<20} {node.name or '(unnamed)'}: ({inputs}) -> ({outputs})")


# ---------------------------------------------------------------------------------------------- main

def register(subparsers) -> None:
    run = subparsers.add_parser("run", help="run a model on given or generated inputs, time it",
                                description="Run MODEL. Inputs not given with -i are generated from their names "
                                            "and types: ids -> zeros, masks -> ones, floats -> random normal "
                                            "(--seed), others -> zeros; symbolic dimensions from --dim (default 1).")
    run.add_argument("model", metavar="MODEL", help="an .onnx file")
    run.add_argument("-i", "--input", action="append", default=[], metavar="NAME=FILE",
                     help="feed input NAME from a .npy, .npz or .safetensors file; a bare FILE.npz (or "
                          ".safetensors) feeds all its arrays by name (repeatable)")
    run.add_argument("--dim", action="append", default=[], metavar="NAME=N",
                     help="size of a symbolic dimension for generated inputs (repeatable; default 1)")
    run.add_argument("-n", "--iterations", type=int, default=1, metavar="ITERS", help="runs to time (default 1)")
    run.add_argument("--seed", type=int, default=0, help="seed of generated random inputs (default 0)")
    run.add_argument("--profile", action="store_true", help="print time per op type and in-place statistics")
    run.add_argument("--output", nargs="+", action="extend", metavar="NAME",
                     help="compute only these outputs (intermediate values allowed)")
    run.add_argument("--save", metavar="OUT.npz", help="save the outputs to an .npz file")
    run.set_defaults(func=command_run, compile_key=run_compile_key, compile_argv=run_compile_argv)

    inspect = subparsers.add_parser("inspect", help="describe a model: I/O, opsets, parameters, ops, support",
                                    description="Describe MODEL without running it (works on models runnx "
                                                "cannot load): inputs/outputs, opsets, parameter count, op "
                                                "histogram including subgraphs, ops runnx lacks.")
    inspect.add_argument("model", metavar="MODEL", help="an .onnx file")
    inspect.add_argument("--plan", action="store_true", help="also load the model and print its execution plan")
    inspect.set_defaults(func=command_inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runnx", description="runnx: an ONNX interpreter in Python.")
    parser.add_argument("--version", action="version", version=f"runnx {_version()}")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of runnx errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(subparsers)
    for module_name in PLUGINS:
        try:
            plugin = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # that part of runnx is not there (yet): no such subcommand
            raise
        plugin.register(subparsers)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("runnx")
    except PackageNotFoundError:
        return "unknown"


def main(argv=None) -> int:
    from runnx import background_compile
    from runnx.errors import RunnxError
    from runnx.runtime import keep_freed, sleep_after_calls
    parser = build_parser()
    args = parser.parse_args(argv)
    first_run = None
    code = EXIT_ERROR
    try:
        keep_freed()  # the command's own process: its runs' freed temporaries stay mapped (runtime/allocator.py)
        sleep_after_calls()  # and OpenBLAS's threads sleep after each call, decided before any thread starts
        first_run = background_compile.start(args)
        code = args.func(args) or 0
    except (RunnxError, CliError) as error:
        if args.traceback:
            raise
        print(f"runnx: error: {one_line(error)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `runnx inspect big.onnx | head`
        sys.stderr.close()
        code = 0
        return 0
    finally:
        background_compile.finish(first_run, code)
    return code


def one_line(error: Exception) -> str:
    """The error on one line: multi-line messages (a list of unsupported ops) are joined with '; '."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
