"""Child process that does every piece of MNN work for the control plane.

Run as ``python -m control_plane.registry.mnn_worker <op> --result-fd N ...`` by
`control_plane.registry.mnn_tools`, never imported by a long-lived process: ``import MNN`` prints to
stdout and a malformed model can crash native code, so both must stay in a throwaway process.

Protocol: models arrive and leave as inherited memfds addressed as ``/proc/self/fd/N``, and
the converter's own scratch file is redirected to a memfd too, so no plaintext weights ever
touch a filesystem. The parent starts us in a private, empty working directory with an empty
environment. Before reading any model the worker imports everything it will need, then
confines itself for good (`runtime.hardening.confine`: memory and CPU limits, another user
when started as root, seccomp) and reports the confinement with its result. The single
JSON result is written to the memfd ``--result-fd``; stdout and stderr (including MNN's
native logging) go to the parent, which keeps them for diagnostics. The exit status is 0
when the result says ``"ok": true``.

MNN's Python wheel also ships ``MNN.tools`` whose converter wrappers upload usage data to a
third-party service (``MNN.tools.utils.log``) and may pip-install packages. The worker calls
the native converter (``_tools.mnnconvert``) directly and blocks those modules outright.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import resource
import sys
from collections.abc import Callable, Iterator
from typing import Any

from contract import errors
from control_plane.registry.mnn_flatbuffer import MalformedModel, external_paths
from control_plane.registry.mnn_tools import VARIANT_FLAGS
from runtime.hardening import confine, forbid_core_dumps
from runtime.mnn_host import (
    dtype_name,
    fd_path,
    forbidden_loaded,
    install_import_guard,
    line_buffer_native_stdout,
)

BIZ_CODE = "skiff"  # recorded in every model we write, visible in MNN's get_info()

_NATIVE = ("MNN", "_mnncengine", "_tools")  # top-level names of MNN's Python and native parts
_SPILL_NAME = ".__convert_external_data.bin"  # hard-coded in MNN's converter; see _spill_to_memfd

# MNN's log decorations: "[20:36:58] :220: " timestamps and "[ERROR] " tags.
_LOG_PREFIX = re.compile(r"^(\[\d\d:\d\d:\d\d\]\s*)?(:\d+:\s*)?(\[ERROR\]\s*)?")
_LOG_PATH = re.compile(r"\s*:?\s*/proc/self/fd/\d+")


class WorkerError(Exception):
    """An expected failure (bad model, converter refusal), reported as one line."""


def main(argv: list[str] | None = None) -> int:
    """Run one operation and write its JSON result; return the exit status."""
    args = _parser().parse_args(argv)
    forbid_core_dumps()  # a converter crash must not write the plaintext model to disk
    install_import_guard()
    line_buffer_native_stdout()
    _preload(args.op)
    confinement = confine(
        memory_bytes=args.memory_limit, cpu_seconds=args.cpu_limit, uid=args.uid, gid=args.gid
    )
    payload = _run_op(args)
    payload["confinement"] = confinement.to_dict()
    os.pwrite(args.result_fd, json.dumps(payload).encode(), 0)
    return 0 if payload["ok"] else 1


def _preload(op: str) -> None:
    """Import what `op` needs while the interpreter's files are still readable.

    After `confine` the worker may run as a user who cannot read them (a Python under
    /root), and a lazy import would then fail halfway through a conversion.
    """
    import MNN  # noqa: F401
    import numpy  # noqa: F401

    if op == "convert":
        import onnx  # noqa: F401
    if op == "golden":
        import encodings.cp437  # noqa: F401 - zipfile decodes .npz member names with it
        import secrets  # noqa: F401
        import zipfile  # noqa: F401

        import numpy.random  # noqa: F401 - seeded inputs; it imports `secrets` lazily

        import control_plane.registry.golden  # noqa: F401
        import runtime.engine  # noqa: F401
        import runtime.golden  # noqa: F401
        import runtime.npz  # noqa: F401
    if op == "llm":
        import encodings.ascii  # noqa: F401 - /proc/self/status is read as ASCII
        import importlib.resources  # noqa: F401 - MNN.llm reads its package data
        import mmap  # noqa: F401

        import gguf  # noqa: F401 - imported lazily by the GGUF reader

        import control_plane.registry.llm.build  # noqa: F401 - numpy, MNN.expr, MNN.llm
        import runtime.hardening  # noqa: F401
        import runtime.mnn_host  # noqa: F401
    if op not in ("inspect", "golden"):
        import _tools  # noqa: F401


def _run_op(args: argparse.Namespace) -> dict[str, Any]:
    """Run the requested operation; any failure becomes an ``"ok": false`` result."""
    try:
        payload: dict[str, Any] = {"ok": True, **_OPS[args.op](args)}
    except WorkerError as exc:
        payload = {"ok": False, "error": str(exc)}
    except errors.InvalidArgument as exc:  # the publisher's inputs or hints, not the model
        payload = {"ok": False, "error": str(exc), "caller_error": True}
    except Exception as exc:  # noqa: BLE001 - any failure must reach the parent as a result
        payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    payload["forbidden_modules"] = forbidden_loaded()
    if payload["forbidden_modules"]:
        payload.update(ok=False, error=f"forbidden modules loaded: {payload['forbidden_modules']}")
    # What ran, and how much memory it took: for tests, benchmarks and capacity planning.
    payload["native_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in _NATIVE)
    payload["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return payload


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model, run it once on zeros if its shapes are static, report its signature."""
    import MNN

    _reject_external_weights(args.model_fd)
    path = fd_path(args.model_fd)
    start = _log_position()
    try:
        module = MNN.nn.load_module_from_file(path, [], [])
    except Exception as exc:
        reason = _log_reason(start) or str(exc)
        raise WorkerError(f"MNN refused to load it ({reason})") from None
    info = module.get_info()
    # get_info() pairs input names with nameless Vars carrying the shapes and dtypes.
    inputs = [
        _spec(name, var) for name, var in zip(info["inputNames"], info["inputs"], strict=True)
    ]
    if all(dim >= 0 for spec in inputs for dim in spec["shape"]):
        outputs = _run_on_zeros(module, info)
    else:
        del module  # a second copy of the weights is about to be loaded
        outputs = _declared_outputs(path, info["outputNames"])
    version = info.get("version") or MNN.version()
    return {"signature": {"inputs": inputs, "outputs": outputs, "mnn_version": version}}


def _run_on_zeros(module: Any, info: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one forward pass on all-zero inputs; return the output specs it produced."""
    names = info["outputNames"]
    start = _log_position()
    try:
        results = module.forward(_zero_feeds(info["inputs"]))
        for out in results:
            out.read()  # force the computation: shapes alone can be inferred without running
        error = "" if len(results) == len(names) else f"{len(results)} of {len(names)} outputs"
    except Exception as exc:  # noqa: BLE001 - MNN's Python binding raises assorted types
        error = str(exc) or type(exc).__name__
    if error:
        raise WorkerError(f"forward pass on zeros failed: {_log_reason(start) or error}")
    return [_spec(name, out) for name, out in zip(names, results, strict=True)]


def _zero_feeds(inputs: list[Any]) -> list[Any]:
    """Build all-zero input Vars matching the model's declared inputs."""
    import MNN
    import numpy as np

    expr = MNN.expr
    feeds = []
    for var in inputs:
        shape = list(var.shape)
        feed = expr.placeholder(shape, expr.NCHW, var.dtype)
        feed.write(np.zeros(shape, dtype_name(var)))
        # Models that take NC4HW4 input want MNN's packed layout, not plain NCHW.
        feeds.append(feed if var.data_format == expr.NCHW else expr.convert(feed, var.data_format))
    return feeds


def _declared_outputs(path: str, names: list[str]) -> list[dict[str, Any]]:
    """Report output specs from shape inference alone; unknowable ones get shape ()."""
    import MNN

    found = MNN.expr.load_as_dict(path)
    specs = []
    for name in names:
        try:
            specs.append(_spec(name, found[name]))
        except Exception:  # noqa: BLE001 - MNN raises assorted errors for unknown shapes
            specs.append({"name": name, "shape": [], "dtype": "unknown"})
    return specs


def _spec(name: str, var: Any) -> dict[str, Any]:
    """Describe one MNN Var as a JSON-able tensor spec."""
    shape = var.shape
    if shape is None:
        raise WorkerError(f"MNN cannot infer the shape of {name!r}")
    return {"name": name, "shape": list(shape), "dtype": dtype_name(var)}


def _golden(args: argparse.Namespace) -> dict[str, Any]:
    """Run golden inputs through the model with the reference config.

    With --recipe-fd (the base model of a push), the inputs are built here from the
    model's signature, the recipe's hints and the publisher's ``.npz`` in --inputs-fd
    (`control_plane.registry.golden.golden_inputs`), written to --built-fd, and the input
    signature is reported: one child both inspects the model and runs it. Otherwise
    --inputs-fd holds the inputs to run. The outputs go to --outputs-fd as an
    uncompressed ``.npz``; their specs are what this run produced (real shapes).
    """
    from runtime.backends import REFERENCE_CONFIG
    from runtime.engine import InProcessExecutor
    from runtime.errors import RuntimeFailure
    from runtime.golden import MAX_GOLDEN_BYTES
    from runtime.npz import read_npz, write_npz

    _reject_external_weights(args.model_fd)
    given = os.pread(args.inputs_fd, os.fstat(args.inputs_fd).st_size, 0)
    try:
        executor = InProcessExecutor(fd_path(args.model_fd), REFERENCE_CONFIG)
    except RuntimeFailure as exc:
        raise WorkerError(f"MNN refused to load it ({exc})") from None
    specs = executor.signature.inputs
    result: dict[str, Any] = {}
    if args.recipe_fd is not None:
        feeds = _built_inputs(specs, given, args.recipe_fd)
        os.pwrite(args.built_fd, write_npz(feeds), 0)
        result["inputs"] = [_spec_of(s.name, s.shape, s.dtype) for s in specs]
        result["mnn_version"] = executor.mnn_version
    else:
        feeds = read_npz(given, "golden inputs", MAX_GOLDEN_BYTES)
    missing = [s.name for s in specs if s.name not in feeds]
    if missing:
        raise WorkerError(f"no golden input for {missing[0]!r}")
    try:
        outputs = executor.run([feeds[s.name] for s in specs], exact=False)
    except RuntimeFailure as exc:
        raise WorkerError(f"the reference config cannot run the golden inputs ({exc})") from None
    os.pwrite(args.outputs_fd, write_npz(outputs), 0)
    result["outputs"] = [_spec_of(n, a.shape, a.dtype.name) for n, a in outputs.items()]
    return result


def _built_inputs(specs: Any, publisher: bytes, recipe_fd: int) -> dict[str, Any]:
    """Build the golden inputs for `specs` (errors.InvalidArgument: the publisher's fault)."""
    from control_plane.registry.golden import GoldenRequest, golden_inputs
    from control_plane.registry.mnn_tools import TensorSpec

    recipe = json.loads(os.pread(recipe_fd, os.fstat(recipe_fd).st_size, 0))
    request = GoldenRequest(
        golden=publisher,
        input_shapes={k: tuple(v) for k, v in recipe["input_shapes"].items()},
        input_ranges={k: (float(lo), float(hi)) for k, (lo, hi) in recipe["input_ranges"].items()},
    )
    return golden_inputs([TensorSpec(s.name, s.shape, s.dtype) for s in specs], request)


def _spec_of(name: str, shape: Any, dtype: str) -> dict[str, Any]:
    return {"name": name, "shape": [int(d) for d in shape], "dtype": dtype}


def _convert(args: argparse.Namespace) -> dict[str, Any]:
    """Convert the ONNX model in --src-fd to MNN in --dst-fd."""
    _reject_external_data(args.src_fd)
    return _run_converter(["-f", "ONNX"], args.src_fd, args.dst_fd)


def _variant(args: argparse.Namespace) -> dict[str, Any]:
    """Rewrite the MNN model in --src-fd as the named variant in --dst-fd."""
    _verify_mnn(args.src_fd)
    _reject_external_weights(args.src_fd)
    return _run_converter(["-f", "MNN", *VARIANT_FLAGS[args.variant]], args.src_fd, args.dst_fd)


def _verify_mnn(fd: int) -> None:
    """Run MNN's flatbuffer verifier: the converter itself segfaults on malformed .mnn input."""
    import MNN

    start = _log_position()
    try:
        MNN.Interpreter(fd_path(fd))  # verifies and parses; no session, so no weight setup
    except Exception as exc:  # noqa: BLE001 - the binding raises a bare Exception
        raise WorkerError(f"not a valid MNN model ({_log_reason(start) or exc})") from None


def _run_converter(flags: list[str], src_fd: int, dst_fd: int) -> dict[str, Any]:
    """Run MNN's native converter between two memfds; fail unless it wrote a model."""
    import _tools  # the native converter, without the MNN.tools wrapper that phones home

    start = _log_position()
    argv = ["mnnconvert", *flags, "--modelFile", fd_path(src_fd)]
    argv += ["--MNNModel", fd_path(dst_fd), "--bizCode", BIZ_CODE]
    with _spill_to_memfd():
        _tools.mnnconvert(argv)  # returns True even on failure: judge by the output and log
    failed = any("Converted Failed" in line for line in _log_lines(start))
    size = os.fstat(dst_fd).st_size
    if failed or size == 0:
        raise WorkerError(_log_reason(start) or "the converter wrote no model")
    return {"bytes": size}


@contextlib.contextmanager
def _spill_to_memfd() -> Iterator[None]:
    """Point the converter's weight spill file at a memfd, so weights never reach a disk.

    MNN's graph optimiser writes every weight to ".__convert_external_data.bin" in the current
    directory, reads it back by name and unlinks it; the name is hard-coded. A symlink of that
    name to /proc/self/fd/N sends both opens to our memfd; MNN's unlink removes the symlink.
    The parent runs us in a private, throwaway directory, so the name is ours alone.
    """
    spill = os.memfd_create("skiff-mnn-spill", os.MFD_CLOEXEC)
    try:
        os.symlink(fd_path(spill), _SPILL_NAME)
    except OSError as exc:
        os.close(spill)
        raise WorkerError(f"cannot keep the converter's scratch file in memory ({exc})") from None
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_SPILL_NAME)
        os.close(spill)


def _reject_external_data(src_fd: int) -> None:
    """Refuse ONNX models whose tensors point at external files.

    MNN resolves external-data locations relative to the model's directory, which for us is
    /proc/self/fd: "../../../etc/passwd" would copy a host file into the converted model.
    """
    import onnx

    with open(fd_path(src_fd), "rb") as src:
        try:
            model = onnx.ModelProto.FromString(src.read())
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise WorkerError(f"not a readable ONNX protobuf ({type(exc).__name__})") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in _all_tensors(model)):
        raise WorkerError("tensors stored as external data are not supported")


def _reject_external_weights(fd: int) -> None:
    """Refuse .mnn models whose ops name a file to read weights from (see mnn_flatbuffer)."""
    with open(fd_path(fd), "rb") as src:
        data = src.read()
    try:
        paths = external_paths(data)
    except MalformedModel as exc:
        raise WorkerError(f"MNN refused to load it ({exc})") from None
    if paths:
        raise WorkerError("ops that read weights from external files are not supported")


def _all_tensors(model: Any) -> Any:
    """Yield every TensorProto in the model, including attributes and subgraphs."""
    graphs = [model.graph]
    graphs += [g for info in model.training_info for g in (info.initialization, info.algorithm)]
    nodes = [node for function in model.functions for node in function.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            nodes.extend(graph.node)
            continue
        for attr in nodes.pop().attribute:
            yield from (attr.t, *attr.tensors)
            for sparse in (attr.sparse_tensor, *attr.sparse_tensors):
                yield from (sparse.values, sparse.indices)
            graphs.extend([attr.g, *attr.graphs])


def _log_position() -> int:
    """Return where the next native log line will land in our stderr file."""
    _flush_all()
    try:
        return os.fstat(2).st_size
    except OSError:
        return 0


def _log_lines(start: int) -> list[str]:
    """Return what stdout/stderr received since `start` (empty if stderr is not a file)."""
    _flush_all()
    try:
        end = os.fstat(2).st_size
        return os.pread(2, max(0, end - start), start).decode(errors="replace").splitlines()
    except OSError:
        return []


def _log_reason(start: int) -> str:
    """Pick the most telling error line MNN printed since `start`, tidied up."""
    lines = [line.strip() for line in _log_lines(start) if line.strip()]
    for marker in ("Not Support", "[ERROR]", "Check failed", "Invalid", "Error", "error"):
        for line in lines:
            if marker in line:
                # "/proc/self/fd/N" means nothing to whoever uploaded the model.
                return _LOG_PATH.sub("", _LOG_PREFIX.sub("", line)).strip()
    return ""


def _flush_all() -> None:
    """Flush Python's and C's stdio buffers so the log file is complete."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _llm(args: argparse.Namespace) -> dict[str, Any]:
    """Convert a GGUF into one bundle per variant and score each against the reference."""
    from control_plane.registry.llm.build import build

    recipe = json.loads(os.pread(args.recipe_fd, os.fstat(args.recipe_fd).st_size, 0))
    outputs = {}
    for item in (args.bundle_fds or "").split(","):
        name, _, fd = item.partition("=")
        outputs[name] = int(fd)
    return build(fd_path(args.src_fd), recipe, outputs, args.outputs_fd)


_OPS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "inspect": _inspect,
    "golden": _golden,
    "convert": _convert,
    "variant": _variant,
    "llm": _llm,
}


def _parser() -> argparse.ArgumentParser:
    """Build the command-line parser for the worker's three operations."""
    parser = argparse.ArgumentParser(prog="python -m control_plane.registry.mnn_worker")
    parser.add_argument("op", choices=sorted(_OPS))
    parser.add_argument("--result-fd", type=int, required=True)
    parser.add_argument("--model-fd", type=int)
    parser.add_argument("--src-fd", type=int)
    parser.add_argument("--dst-fd", type=int)
    parser.add_argument("--inputs-fd", type=int, help="golden op: .npz of inputs by name")
    parser.add_argument("--outputs-fd", type=int, help="golden op: .npz of outputs, written")
    parser.add_argument("--recipe-fd", type=int, help="golden op: JSON hints; build inputs")
    parser.add_argument("--built-fd", type=int, help="golden op: .npz of built inputs, written")
    parser.add_argument("--variant", choices=sorted(VARIANT_FLAGS))
    parser.add_argument("--bundle-fds", help="llm op: NAME=FD,... a memfd per variant's bundle")
    parser.add_argument("--memory-limit", type=int, required=True, help="RLIMIT_AS, bytes")
    parser.add_argument("--cpu-limit", type=int, required=True, help="RLIMIT_CPU, seconds")
    parser.add_argument("--uid", type=int, help="user to switch to (when started as root)")
    parser.add_argument("--gid", type=int)
    return parser


if __name__ == "__main__":
    sys.exit(main())
