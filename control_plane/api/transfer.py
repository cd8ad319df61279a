"""What the admin client reads and writes locally for pushes and pulls.

Model files are hashed before upload (the server checks size and SHA-256), streamed as
1 MiB chunks after any golden inputs, and pulled models are written beside their
destination, checked against the signed manifest, and only then renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from contract import errors
from control_plane.registry.contract import MAX_GOLDEN_UPLOAD
from protos import admin_pb2

CHUNK = 1 << 20
# Called with (bytes done, bytes in all) as a transfer goes.
Progress = Callable[[int, int], None]


def size_and_digest(path: Path) -> tuple[int, str]:
    """Return a file's size and SHA-256, read once; InvalidArgument if it cannot be read."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return path.stat().st_size, digest.hexdigest()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read {path}: {exc.strerror}") from None


def read_golden(path: Path) -> bytes:
    """Read a golden-inputs file, refusing one over the server's limit before sending it."""
    try:
        size = path.stat().st_size
        if size > MAX_GOLDEN_UPLOAD:
            raise errors.TooLarge(
                f"{path}: {size} bytes of golden inputs, over the {MAX_GOLDEN_UPLOAD}-byte limit"
            )
        return path.read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read golden inputs {path}: {exc.strerror}") from None


def read_pipeline(path: Path) -> str:
    """Read a pipeline spec file: JSON of at most 64 KiB (the server checks the rest)."""
    from runtime.pipeline_spec import MAX_PIPELINE_BYTES

    try:
        with path.open("rb") as f:  # read, not stat: a pipe or a device has no size
            data = f.read(MAX_PIPELINE_BYTES + 1)
        if len(data) > MAX_PIPELINE_BYTES:
            raise errors.TooLarge(f"{path}: pipeline spec over the {MAX_PIPELINE_BYTES}-byte limit")
        text = data.decode("utf-8")
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read pipeline {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise errors.InvalidArgument(f"pipeline {path} is not UTF-8 text") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"pipeline {path} is not JSON: {exc}") from None
    return text


def push_requests(
    path: Path, header: admin_pb2.PushHeader, progress: Progress | None, golden: bytes = b""
) -> Iterator[admin_pb2.PushModelRequest]:
    """Yield a push: the header, the golden inputs' chunks, then the model's chunks."""
    yield admin_pb2.PushModelRequest(header=header)
    for start in range(0, len(golden), CHUNK):
        yield admin_pb2.PushModelRequest(golden_chunk=golden[start : start + CHUNK])
    sent = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            sent += len(chunk)
            if progress:
                progress(sent, header.size)
            yield admin_pb2.PushModelRequest(chunk=chunk)


def write_verified(chunks, out: Path, expected: tuple[int, str], progress: Progress | None) -> None:
    """Write to a new 0600 temp file beside `out`, check it, then rename it into place.

    The temp file is created with O_EXCL|O_NOFOLLOW, so a file or symlink planted at its
    name is never written through; `out` itself, if a symlink, is replaced, not followed.
    """
    want_size, want_sha256 = expected
    out = Path(out).absolute()
    out = out.parent.resolve() / out.name
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        raise errors.AlreadyExists(f"{tmp} already exists: remove it and pull again") from None
    digest, size = hashlib.sha256(), 0
    try:
        # Each piece is hashed and written in a thread while the next one is received
        # (both release the GIL), one piece behind; in order, and the first error stops it.
        with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(1, "skiff-pull-write") as writer:
            behind = None
            for response in chunks:
                chunk = response.chunk  # each read of the field copies it out of the message
                size += len(chunk)
                if size > want_size:  # a stream past the signed size stops here, not at the end
                    raise _mismatch(size)
                if behind is not None:
                    behind.result()
                behind = writer.submit(_absorb, digest, f, chunk)
                if progress:
                    progress(size, want_size)
            if behind is not None:
                behind.result()
            f.flush()
            os.fsync(f.fileno())
        if size != want_size or digest.hexdigest() != want_sha256:
            raise _mismatch(size)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _absorb(digest, f, chunk: bytes) -> None:
    digest.update(chunk)
    f.write(chunk)


def _mismatch(size: int) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"downloaded model does not match its signed manifest ({size} bytes)"
    )
