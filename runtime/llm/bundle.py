"""MNN-LLM bundles: a flat set of files, read from one tar into sealed memfds.

A bundle is what MNN's exporter writes: ``config.json`` (runtime settings),
``llm_config.json`` (the model's shape, chat template, merged over ``config.json`` by
MNN), ``llm.mnn`` (the graph), ``llm.mnn.weight``, a tokenizer (``tokenizer.txt`` or
``tokenizer.mtok``) and ``embeddings_bf16.bin`` unless the embeddings are tied to the
output head. It travels as one artifact, a plain tar (`write_bundle_tar` makes the
canonical one), and arrives decrypted as a stream of bytes.

`read_bundle_tar` reads that stream without trusting it: only regular files with the
bundle's own flat names, each once and within its size bound, every refusal naming the
member. Each file goes into a sealed memfd, so the plaintext never touches a filesystem.
`validate_bundle` checks the set and both JSON configs (a config that names a file must
name one of the bundle's; MNN would otherwise open whatever path it says, and vision or
audio parts are refused: Skiff serves text). `BundleDir` is how MNN-LLM, which only
loads from a directory path, gets at the memfds: a private directory of symlinks to
``/proc/self/fd/N`` plus an ordinary ``config.json`` (it holds no secrets). MNN refused
a config naming ``/proc/self/fd/N`` directly; the symlinks load (see FACTS.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import tarfile
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from runtime._stdio import memfd
from runtime.errors import RuntimeFailure, UnsupportedPlatform

__all__ = [
    "BUNDLE_FILES",
    "DEFAULT_LIMITS",
    "BundleDir",
    "BundleInfo",
    "InvalidBundle",
    "close_files",
    "read_bundle_tar",
    "validate_bundle",
    "write_bundle_fds",
    "write_bundle_tar",
]

CONFIG, LLM_CONFIG, GRAPH, WEIGHT = "config.json", "llm_config.json", "llm.mnn", "llm.mnn.weight"
TOKENIZERS = ("tokenizer.txt", "tokenizer.mtok")
EMBEDDINGS = "embeddings_bf16.bin"
BUNDLE_FILES = frozenset({CONFIG, LLM_CONFIG, GRAPH, WEIGHT, EMBEDDINGS, *TOKENIZERS})
# What MNN's exporter leaves beside a bundle that no runtime reads: left out of the tar.
EXPORT_LEFTOVERS = frozenset({"llm.mnn.json", "llm.onnx", "llm.onnx.data"})

_MiB, _GiB = 1 << 20, 1 << 30
# Per-member bounds. A bigger member is refused from its header, before a byte is read.
DEFAULT_LIMITS: Mapping[str, int] = {
    CONFIG: _MiB,
    LLM_CONFIG: 4 * _MiB,  # may carry a long jinja chat template
    GRAPH: 256 * _MiB,  # the graph only: weights live in llm.mnn.weight
    WEIGHT: 32 * _GiB,
    EMBEDDINGS: 8 * _GiB,
    "tokenizer.txt": 128 * _MiB,
    "tokenizer.mtok": 128 * _MiB,
}
_JSON_DEPTH = 16
_CHUNK = 1 << 20
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE

# Config keys MNN-LLM reads as file names (relative to the bundle directory), and the
# bundle file each must name. Any other key that names a file is refused below.
_FILE_KEYS = {
    "llm_config": (LLM_CONFIG,),
    "llm_model": (GRAPH,),
    "llm_weight": (WEIGHT,),
    "embedding_file": (EMBEDDINGS,),
    "tokenizer_file": TOKENIZERS,
}
_PATH_SUFFIXES = ("_model", "_file", "_weight", "_dir", "_path", "_dict", "_fc", "_d2t")
# Parts of MNN's multimodal and speculative models: each needs files Skiff does not ship.
_MODALITY_FLAGS = {
    "is_visual": "vision",
    "is_audio": "audio",
    "has_talker": "speech output (talker)",
    "is_mrope": "vision (multimodal RoPE)",
    "has_deepstack": "vision (deepstack)",
}
_MODALITY_KEYS = {"mllm": "a multimodal sub-model", "speculative_type": "speculative decoding"}
# (min, max) for the integers Skiff reads or that size MNN's allocations.
_INT_BOUNDS = {
    "hidden_size": (1, 1 << 16),
    "layer_nums": (1, 1024),
    "max_all_tokens": (1, 1 << 20),
    "max_new_tokens": (1, 1 << 20),
    "thread_num": (1, 1024),
    "sliding_window": (0, 1 << 20),
}
DEFAULT_CONTEXT = 2048  # MNN-LLM's own default for max_all_tokens


class InvalidBundle(RuntimeFailure, ValueError):
    """A bundle (tar, file set or config) that Skiff refuses; the message names the part."""


@dataclass(frozen=True)
class BundleInfo:
    """What validation learned about a bundle, for the session and the registry."""

    tokenizer: str
    tied_embeddings: bool
    chat_template: str | None  # the jinja template, or None if the bundle has none
    context_length: int  # max_all_tokens: prompt plus generated tokens
    hidden_size: int
    layer_nums: int
    config: Mapping[str, Any] = field(repr=False)  # config.json as published
    llm_config: Mapping[str, Any] = field(repr=False)


# ---------------------------------------------------------------- reading a tar


def read_bundle_tar(
    source: IO[bytes] | Iterable[bytes], *, limits: Mapping[str, int] = DEFAULT_LIMITS
) -> dict[str, int]:
    """Read an uncompressed bundle tar into sealed memfds; return ``{name: fd}``.

    `source` is a binary file object or an iterable of byte chunks (a decrypting
    stream). Members must be regular files with the bundle's flat names (a leading
    ``./`` and one ``./`` directory entry are tolerated, as ``tar -C dir .`` writes
    them), each at most once and within `limits`. Anything else (absolute or ``..``
    paths, nested names, links, devices, FIFOs, sparse files, unknown or duplicate
    names, oversize or truncated members) raises InvalidBundle naming the member; every
    memfd made so far is closed. The caller owns the returned descriptors
    (`close_files`). The file set itself is checked by `validate_bundle`.
    """
    if not hasattr(os, "memfd_create"):
        raise UnsupportedPlatform("memfd_create is not available: cannot keep bundles off disk")
    fileobj = source if hasattr(source, "read") else _ChunkReader(source)  # type: ignore[arg-type]
    files: dict[str, int] = {}
    try:
        # "r|": a forward-only stream of an *uncompressed* tar; no seeking, no guessing.
        with tarfile.open(fileobj=fileobj, mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                name = _member_name(member, limits)
                if name is None:
                    continue
                if name in files:
                    raise InvalidBundle(f"bundle tar: member {member.name!r} appears twice")
                reader = tar.extractfile(member)
                assert reader is not None  # a regular file, checked above
                files[name] = _sealed_copy(reader, member, limits[name])
    except tarfile.TarError as exc:
        close_files(files)
        raise InvalidBundle(f"bundle tar: not a readable uncompressed tar ({exc})") from None
    except BaseException:
        close_files(files)
        raise
    return files


def _member_name(member: tarfile.TarInfo, limits: Mapping[str, int]) -> str | None:
    """Return the bundle name `member` holds, None for a skippable ``./`` entry, or raise."""
    raw = member.name
    shown = repr(raw)
    if raw.startswith("/") or raw.startswith("\\"):
        raise InvalidBundle(f"bundle tar: member {shown} has an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts or "\\" in raw or "\0" in raw:
        raise InvalidBundle(f"bundle tar: member {shown} escapes the bundle (..)")
    if member.isdir():
        if not parts:
            return None  # "./", the directory tar -C dir . starts with
        raise InvalidBundle(f"bundle tar: member {shown} is a directory; bundles are flat")
    kind = _kind(member)
    if kind:
        raise InvalidBundle(f"bundle tar: member {shown} is a {kind}, not a regular file")
    if len(parts) != 1:
        raise InvalidBundle(f"bundle tar: member {shown} is nested; bundles are flat")
    name = parts[0]
    if name not in BUNDLE_FILES:
        raise InvalidBundle(f"bundle tar: unknown member {shown}{_unknown_hint(name)}")
    limit = limits[name]
    if member.size > limit:
        raise InvalidBundle(
            f"bundle tar: member {shown} is {member.size} bytes, over its {limit}-byte limit"
        )
    return name


def _unknown_hint(name: str) -> str:
    """Say why a file has no place in a bundle: a model part Skiff does not serve, or not."""
    if name.endswith((".mnn", ".mnn.weight")) or name.startswith(("visual", "audio", "talker")):
        return (
            " (a vision, audio or other model part: Skiff serves text-only MNN-LLM bundles,"
            " of llm.mnn alone)"
        )
    return f" (a text-only MNN-LLM bundle holds only {', '.join(sorted(BUNDLE_FILES))})"


def _kind(member: tarfile.TarInfo) -> str:
    """Name what a non-regular member is ('' for a regular file)."""
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.ischr() or member.isblk():
        return "device file"
    if member.isfifo():
        return "FIFO"
    if member.issparse():
        return "sparse file"
    if not member.isreg():
        return f"member of type {member.type!r}"
    return ""


def _sealed_copy(reader: IO[bytes], member: tarfile.TarInfo, limit: int) -> int:
    """Copy one member into a new sealed memfd, checking its length as it goes."""
    fd = memfd(f"skiff-llm-{member.name[-40:]}", os.MFD_ALLOW_SEALING)
    try:
        total = 0
        while chunk := reader.read(_CHUNK):
            total += len(chunk)
            if total > min(limit, member.size):  # the header lied about the size
                raise InvalidBundle(f"bundle tar: member {member.name!r} is longer than declared")
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        if total != member.size:
            raise InvalidBundle(
                f"bundle tar: member {member.name!r} is truncated ({total} of {member.size} bytes)"
            )
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _ChunkReader(io.RawIOBase):
    """A forward-only file object over an iterable of byte chunks (for tarfile)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(bytes(chunk))
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def close_files(files: Mapping[str, int]) -> None:
    """Close every memfd of a bundle (ignoring ones already closed)."""
    for fd in files.values():
        with contextlib.suppress(OSError):
            os.close(fd)


# ---------------------------------------------------------------- validation


def validate_bundle(files: Mapping[str, int]) -> BundleInfo:
    """Check a bundle's file set and configs; return what they say, or raise InvalidBundle.

    `files` maps bundle names to readable descriptors (memfds, or files opened by the
    publisher). Required: ``config.json``, ``llm_config.json``, ``llm.mnn``,
    ``llm.mnn.weight``, the tokenizer the config names (``tokenizer.txt`` by default)
    and ``embeddings_bf16.bin`` unless ``llm_config.json`` declares tied embeddings.
    Both configs must be JSON objects within size and depth bounds, without NaN or
    duplicate keys; a key that names a file must name the bundle's own file of that
    role; ``base_dir`` and other paths are refused, as are vision, audio and
    speculative parts.
    """
    unknown = sorted(set(files) - BUNDLE_FILES)
    if unknown:
        raise InvalidBundle(f"bundle: unknown files {unknown}")
    for name in (CONFIG, LLM_CONFIG, GRAPH, WEIGHT):
        if name not in files:
            raise InvalidBundle(f"bundle: {name} is missing")
    config = _read_json(files, CONFIG)
    llm_config = _read_json(files, LLM_CONFIG)
    merged = {**config, **llm_config}  # MNN merges llm_config.json over config.json
    for source, document in ((CONFIG, config), (LLM_CONFIG, llm_config)):
        _check_keys(source, document, files)
    tokenizer = merged.get("tokenizer_file", "tokenizer.txt")
    if tokenizer not in files:
        raise InvalidBundle(f"bundle: tokenizer {tokenizer} is missing")
    others = [t for t in TOKENIZERS if t != tokenizer and t in files]
    if others:
        raise InvalidBundle(f"bundle: {others[0]} is present but the config uses {tokenizer}")
    if tokenizer == "tokenizer.txt":
        _check_tokenizer_txt(files[tokenizer])
    tied = bool(merged.get("tie_embeddings"))
    if not tied and EMBEDDINGS not in files:
        raise InvalidBundle(
            f"bundle: {EMBEDDINGS} is missing and {LLM_CONFIG} declares no tie_embeddings"
        )
    for name in (GRAPH, WEIGHT):
        if os.fstat(files[name]).st_size == 0:
            raise InvalidBundle(f"bundle: {name} is empty")
    return BundleInfo(
        tokenizer=tokenizer,
        tied_embeddings=tied,
        chat_template=chat_template(merged),
        context_length=_int(merged, "max_all_tokens", DEFAULT_CONTEXT),
        hidden_size=_int(merged, "hidden_size", 0),
        layer_nums=_int(merged, "layer_nums", 0),
        config=config,
        llm_config=llm_config,
    )


def chat_template(config: Mapping[str, Any]) -> str | None:
    """Return the bundle's chat template (``jinja.chat_template``), or None.

    MNN-LLM never reports a missing template: measured with MNN 3.6.1, a bundle without
    ``jinja.chat_template`` in its config gets the message contents back unchanged from
    ``apply_chat_template`` (the legacy ``prompt_template`` and ``*_prompt_template``
    keys are ignored too), so a chat request would silently become a bare completion.
    MNN's exporter writes ``{"jinja": {"chat_template": ..., "bos": ..., "eos": ...}}``
    into ``llm_config.json``; that is the one place a template counts.
    """
    jinja = config.get("jinja")
    if isinstance(jinja, Mapping):
        template = jinja.get("chat_template")
        if isinstance(template, str) and template.strip():
            return template
    return None


def _read_json(files: Mapping[str, int], name: str) -> dict[str, Any]:
    """Parse one config strictly: bounded, an object, no NaN, no duplicate keys."""
    fd = files[name]
    size = os.fstat(fd).st_size
    if size > DEFAULT_LIMITS[name]:
        raise InvalidBundle(f"bundle: {name} is {size} bytes, over {DEFAULT_LIMITS[name]}")
    raw = os.pread(fd, size, 0)
    try:
        document = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidBundle(f"bundle: {name} is not valid JSON ({exc})") from None
    except RecursionError:  # nested past what the parser follows
        raise InvalidBundle(f"bundle: {name} nests deeper than {_JSON_DEPTH} levels") from None
    if not isinstance(document, dict):
        raise InvalidBundle(f"bundle: {name} must hold a JSON object")
    _check_document(name, document)
    return document


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _check_document(name: str, document: dict[str, Any]) -> None:
    """Refuse a document nested past _JSON_DEPTH, or holding a string that is not text.

    Iterative (a deep document must not exhaust the stack here either). A lone UTF-16
    surrogate (JSON's backslash-u D800) decodes to a str that cannot be encoded back; MNN
    crashed on one (SIGSEGV) instead of refusing it.
    """
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > _JSON_DEPTH:
            raise InvalidBundle(f"bundle: {name} nests deeper than {_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for text in (key, item):
                if isinstance(text, str) and not _is_text(text):
                    raise InvalidBundle(f"bundle: {name} holds a string that is not UTF-8 text")
            if isinstance(item, dict | list):
                stack.append((item, depth + 1))


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_keys(source: str, config: Mapping[str, Any], files: Mapping[str, int]) -> None:
    """Refuse paths outside the bundle, non-text parts and out-of-bounds integers."""
    if "base_dir" in config:
        raise InvalidBundle(f"bundle: {source} sets base_dir; a bundle loads from its own files")
    if config.get("is_single", True) is not True:
        raise InvalidBundle(
            f"bundle: {source} sets is_single; split (block_N.mnn) models are not supported"
        )
    for key, value in config.items():
        if key in _MODALITY_FLAGS and value:
            raise InvalidBundle(
                f"bundle: {source} declares {_MODALITY_FLAGS[key]} ({key}); "
                "only text-only models are supported"
            )
        if key in _MODALITY_KEYS and value:
            raise InvalidBundle(
                f"bundle: {source} declares {_MODALITY_KEYS[key]} ({key}); not supported"
            )
        if key in _FILE_KEYS:
            allowed = _FILE_KEYS[key]
            if value not in allowed or value not in files:
                raise InvalidBundle(
                    f"bundle: {source} key {key} names {value!r}, which is not the bundle's "
                    f"own {' or '.join(allowed)}"
                )
        elif key.endswith(_PATH_SUFFIXES) and value not in ("", None, False):
            what = "a vision part" if key.startswith("visual") else "a file outside the bundle"
            if key.startswith("audio"):
                what = "an audio part"
            raise InvalidBundle(f"bundle: {source} key {key} names {value!r}: {what}")
        if key in _INT_BOUNDS:
            _int(config, key, 0, source=source)


def _int(config: Mapping[str, Any], key: str, default: int, *, source: str = "config") -> int:
    """Read a bounded integer (bools and floats refused) or return `default`."""
    if key not in config:
        return default
    value = config[key]
    low, high = _INT_BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidBundle(
            f"bundle: {source} {key}={value!r} is not an integer in [{low}, {high}]"
        )
    return value


def _check_tokenizer_txt(fd: int) -> None:
    """MNN's text tokenizer starts with the magic number 430; anything else fails late."""
    head = os.pread(fd, 16, 0)
    if not head.split(b"\n", 1)[0].split(b" ", 1)[0] == b"430":
        raise InvalidBundle("bundle: tokenizer.txt does not start with MNN's magic number 430")


# ---------------------------------------------------------------- the load directory


class BundleDir:
    """A private directory MNN-LLM loads a bundle from, holding no plaintext.

    Each bundle file but ``config.json`` is a symlink to ``/proc/self/fd/N`` of its
    memfd (so only this process, or a child that inherited the same descriptor numbers,
    can follow it); ``config.json`` is written there as an ordinary file, with
    `overrides` merged in (the session's threads, precision...). The directory is mode
    0700 and removed by `close()` (or when the object is collected). The descriptors
    stay the caller's.
    """

    def __init__(
        self,
        files: Mapping[str, int],
        *,
        overrides: Mapping[str, Any] | None = None,
        parent: str | os.PathLike[str] | None = None,
    ) -> None:
        """Make the directory; `parent` defaults to the system's temp directory."""
        config = _read_json(files, CONFIG)
        config.update(overrides or {})
        path = tempfile.mkdtemp(prefix="skiff-llm-", dir=parent)  # mode 0700
        self._finalizer = weakref.finalize(self, shutil.rmtree, path, True)
        try:
            os.chmod(path, 0o700)
            for name, fd in files.items():
                if name != CONFIG:
                    os.symlink(f"/proc/self/fd/{fd}", os.path.join(path, name))
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            out = os.open(os.path.join(path, CONFIG), flags, 0o600)
            with os.fdopen(out, "w", encoding="utf-8") as handle:
                json.dump(config, handle)
        except BaseException:
            self._finalizer()
            raise
        self.path = Path(path)

    @property
    def config_path(self) -> str:
        """Return the path to hand ``MNN.llm.create``."""
        return str(self.path / CONFIG)

    def close(self) -> None:
        """Remove the directory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> BundleDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- writing a tar


def write_bundle_tar(
    directory: str | os.PathLike[str], out: str | os.PathLike[str] | IO[bytes]
) -> BundleInfo:
    """Pack a publisher's bundle directory into the canonical tar; return its BundleInfo.

    The same files always give the same bytes: members sorted by name, flat, ustar
    format, mtime 0, uid/gid 0, no owner names, mode 0644. Only bundle files go in;
    the exporter's leftovers (``llm.mnn.json``, ``llm.onnx``) are skipped; anything
    else (a vision part, a subdirectory, a symlink) raises InvalidBundle. The set is
    validated before anything is written.
    """
    root = Path(directory)
    names = []
    for entry in sorted(root.iterdir()):
        if entry.name in EXPORT_LEFTOVERS:
            continue
        if entry.is_symlink() or not entry.is_file():
            raise InvalidBundle(f"bundle dir: {entry.name} is not a regular file")
        if entry.name not in BUNDLE_FILES:
            raise InvalidBundle(f"bundle dir: unknown file {entry.name}{_unknown_hint(entry.name)}")
        names.append(entry.name)
    fds: dict[str, int] = {}
    try:
        for name in names:
            fds[name] = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW)
        info = validate_bundle(fds)
        with contextlib.ExitStack() as stack:
            if isinstance(out, str | os.PathLike):
                out = stack.enter_context(open(out, "wb"))
            _write_members(out, names, fds)
        return info
    finally:
        for fd in fds.values():
            os.close(fd)


def write_bundle_fds(files: Mapping[str, int], out_fd: int) -> BundleInfo:
    """Pack a bundle held in descriptors (memfds) into the canonical tar, into `out_fd`.

    The same checks and the same bytes as `write_bundle_tar`; the descriptors' offsets
    are left alone (each member is read through a fresh open of /proc/self/fd/N).
    """
    unknown = sorted(set(files) - BUNDLE_FILES)
    if unknown:
        raise InvalidBundle(f"bundle: unknown file {unknown[0]}")
    info = validate_bundle(files)
    with open(f"/proc/self/fd/{out_fd}", "wb") as out:
        _write_members(out, sorted(files), files)
    return info


def _write_members(out: IO[bytes], names: list[str], fds: Mapping[str, int]) -> None:
    """Write the canonical tar: ustar, fixed metadata, members in the order given."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            member = tarfile.TarInfo(name)
            member.size = os.fstat(fds[name]).st_size
            member.mtime, member.mode = 0, 0o644
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            # A fresh open: its own offset, so the caller's descriptor is not moved.
            with open(f"/proc/self/fd/{fds[name]}", "rb") as handle:
                tar.addfile(member, handle)
