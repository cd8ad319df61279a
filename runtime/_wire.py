"""The worker protocol: one frame per message, a JSON header then raw array bytes.

Frame layout::

    <u32 header length> <u32 payload length> <u32 sequence> <header: UTF-8 JSON> <payload>

The sequence number of a request is echoed in its reply, so a reply can never be taken
for the answer to another request.

The header's ``"arrays"`` lists ``[name, dtype, shape]`` for each array, whose bytes
follow back to back in the payload (C order, native byte order). No pickle anywhere:
the worker runs native code on model bytes and may be compromised, so the parent only
ever parses JSON and copies plain numbers out of the payload, after checking that
dtypes are plain numeric ones and that shapes add up to exactly the payload's size.

Requests repeat the same header (same op, same shapes) over and over, so each side
caches encoded and parsed headers (small ones) by content; small frames are read with
one syscall into a reusable buffer, large ones into their own buffer, which grows as the
bytes actually arrive: a peer claiming a huge payload costs nothing until it sends it.
A malformed frame drops the connection: after one, the stream cannot be trusted.
"""

from __future__ import annotations

import fcntl
import json
import math
import socket
import struct
import sys
import termios
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from runtime.signature import SUPPORTED_DTYPES

__all__ = ["Channel", "Frame", "FrameTooLarge", "ProtocolError"]

_PREFIX = struct.Struct("<III")
MAX_HEADER = 1 << 20
DEFAULT_MAX_PAYLOAD = 1 << 30  # far beyond any on-device tensor set; configurable per channel
_SCRATCH = 1 << 16  # frames up to this size are read into one reusable buffer
_FIRST_CHUNK = 1 << 20  # a large payload's buffer starts here and doubles as bytes arrive
_CACHE_LIMIT = 256  # distinct headers remembered per side
_CACHEABLE = 4096  # longer headers are not cached: bounds the caches to ~1 MiB each
_DTYPES = {name: np.dtype(name) for name in SUPPORTED_DTYPES}
_NO_BYTES = bytes(4)  # FIONREAD's int, filled in by the kernel

_Spec = tuple[str, np.dtype, tuple[int, ...], int]  # name, dtype, shape, element count


class ProtocolError(Exception):
    """The peer sent a frame that breaks the protocol (and is not to be trusted)."""


class FrameTooLarge(ValueError):
    """A frame to send exceeds the protocol's limits; nothing of it was sent."""


class Frame(NamedTuple):
    """One received frame: its sequence number, header and arrays by name."""

    seq: int
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]


class Channel:
    """Frames over a connected stream socket; not thread-safe (callers serialise)."""

    def __init__(self, sock: socket.socket, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        """Use `sock`; frames whose payload exceeds `max_payload` bytes are refused."""
        self.sock = sock
        self.max_payload = min(max_payload, 0xFFFF_FFFF)  # the prefix holds a u32
        self._buffer = bytearray(_SCRATCH)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # unread bytes are _buffer[_start:_end]
        self._encoded: dict[Any, bytes] = {}
        self._parsed: dict[bytes, tuple[dict[str, Any], list[_Spec]]] = {}

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def send(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
        *,
        seq: int = 0,
    ) -> None:
        """Send one frame; `arrays` must use dtypes from SUPPORTED_DTYPES.

        FrameTooLarge (before anything is written) if the payload exceeds the limit.
        """
        items = []
        for name, array in (arrays or {}).items():
            if not array.dtype.isnative or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
            items.append((name, array))
        head = self._encode(header, items)
        buffers = [memoryview(a).cast("B") for _, a in items if a.size]
        payload = sum(b.nbytes for b in buffers)
        if payload > self.max_payload or len(head) > MAX_HEADER:
            raise FrameTooLarge(f"frame too large (header {len(head)}, payload {payload})")
        parts = [_PREFIX.pack(len(head), payload, seq & 0xFFFF_FFFF), head, *buffers]
        sent = self.sock.sendmsg(parts)
        if sent < _PREFIX.size + len(head) + payload:
            _send_rest(self.sock, parts, sent)  # the kernel took part of a large frame

    def recv(self, *, deadline: float | None = None) -> Frame:
        """Receive one frame (do not mutate its header).

        `deadline` is a time.monotonic() value (None waits forever): past it, TimeoutError.
        EOFError if the peer closed the connection cleanly between frames;
        ConnectionError if it went away mid-frame; ProtocolError if the frame is
        malformed, and then the connection is closed.
        """
        try:
            return self._recv(deadline)
        except ProtocolError:
            self.close()  # the byte stream is out of step with the frames for good
            raise

    def frame_ready(self) -> bool:
        """Tell whether a whole frame is here to read (buffered or in the socket): no wait."""
        buffered = self._end - self._start
        waiting = buffered + _unread(self.sock)
        if waiting < _PREFIX.size:
            return False
        prefix = bytes(self._view[self._start : self._end])
        if buffered < _PREFIX.size:
            prefix += self.sock.recv(_PREFIX.size - buffered, socket.MSG_PEEK)
        head_len, payload_len, _ = _PREFIX.unpack_from(prefix)
        return waiting >= _PREFIX.size + head_len + payload_len

    def _recv(self, deadline: float | None) -> Frame:
        """Receive one frame; see `recv`."""
        if deadline is None and self.sock.gettimeout() is not None:
            self.sock.settimeout(None)
        self._fill(_PREFIX.size, deadline, at_start=True)
        head_len, payload_len, seq = _PREFIX.unpack_from(self._buffer, self._start)
        if head_len > MAX_HEADER or payload_len > self.max_payload:
            raise ProtocolError(f"frame too large (header {head_len}, payload {payload_len})")
        total = _PREFIX.size + head_len + payload_len
        if total <= _SCRATCH:
            self._fill(total, deadline)  # may move the unread bytes to the front
            body = self._start + _PREFIX.size
            self._start += total  # consumed even if malformed: never parsed twice
            header, specs = self._parse(bytes(self._view[body : body + head_len]))
            payload = bytearray(self._view[body + head_len : body + head_len + payload_len])
        else:
            self._start += _PREFIX.size
            header, specs = self._parse(bytes(self._take(head_len, deadline)))
            payload = self._take(payload_len, deadline)
        return Frame(seq, header, _slice(specs, payload))

    def _encode(self, header: dict[str, Any], items: list[tuple[str, np.ndarray]]) -> bytes:
        """Return the JSON header for `header` plus the arrays' descriptions (cached)."""
        # dtype objects, not dtype.name: the name is a slow Python-level property.
        described = tuple((name, a.dtype, a.shape) for name, a in items)
        try:
            key: Any = (tuple(header.items()), described)
            hash(key)
        except TypeError:  # unhashable values (e.g. a config dict): rare ops, no cache
            key = None
        head = self._encoded.get(key) if key is not None else None
        if head is None:
            full = {**header, "arrays": [[n, d.name, list(s)] for n, d, s in described]}
            head = json.dumps(full, separators=(",", ":")).encode()
            if key is not None and len(head) <= _CACHEABLE:
                _remember(self._encoded, key, head)
        return head

    def _parse(self, head: bytes) -> tuple[dict[str, Any], list[_Spec]]:
        """Parse and check a header, or reuse the result for identical bytes."""
        cached = self._parsed.get(head)
        if cached is None:
            try:
                header = json.loads(head)
            except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
                raise ProtocolError("frame header is not JSON") from None
            if not isinstance(header, dict):
                raise ProtocolError("frame header is not an object")
            cached = header, _specs(header.get("arrays", []))
            if len(head) <= _CACHEABLE:
                _remember(self._parsed, head, cached)
        return cached

    def _fill(self, size: int, deadline: float | None, *, at_start: bool = False) -> None:
        """Make sure at least `size` unread bytes (size <= _SCRATCH) are buffered."""
        if self._end - self._start >= size:
            return
        if self._start + size > _SCRATCH:  # no room behind the unread bytes: compact
            unread = self._end - self._start
            self._buffer[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        while self._end - self._start < size:
            count = self._recv_into(self._view[self._end :], deadline)
            if count == 0:
                if at_start and self._end == self._start:
                    raise EOFError("peer closed the connection")
                raise ConnectionError("peer closed the connection mid-frame")
            self._end += count

    def _take(self, size: int, deadline: float | None) -> bytearray:
        """Return the next `size` bytes in a fresh buffer (for frames beyond the scratch).

        The buffer doubles as bytes arrive instead of being allocated at the claimed
        size up front, so memory follows what the peer really sent.
        """
        got = min(size, self._end - self._start)
        out = bytearray(min(size, max(_FIRST_CHUNK, got)))
        out[:got] = self._view[self._start : self._start + got]
        self._start += got
        while got < size:
            if got == len(out):
                out.extend(bytes(min(size, 2 * got) - got))
            with memoryview(out) as whole, whole[got:] as view:  # released: out may grow
                count = self._recv_into(view, deadline)
            if count == 0:
                raise ConnectionError("peer closed the connection mid-frame")
            got += count
        return out

    def _recv_into(self, view: memoryview, deadline: float | None) -> int:
        """One recv_into, bounded by the deadline (TimeoutError when it has passed)."""
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no reply before the deadline")
            self.sock.settimeout(remaining)
        return self.sock.recv_into(view)


def _unread(sock: socket.socket) -> int:
    """Return how many bytes wait in the socket's receive queue."""
    count = fcntl.ioctl(sock.fileno(), termios.FIONREAD, _NO_BYTES)
    return int.from_bytes(count, sys.byteorder)


def _specs(described: Any) -> list[_Spec]:
    """Check the header's array descriptions; return (name, dtype, shape, count) tuples."""
    if not isinstance(described, list):
        raise ProtocolError("'arrays' is not a list")
    specs = []
    for item in described:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise ProtocolError("bad array description")
        name, dtype_name, shape = item
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ProtocolError(f"array {name!r} has a dtype outside the protocol")
        if not isinstance(shape, list) or not all(
            type(n) is int and 0 <= n < 1 << 40 for n in shape
        ):
            raise ProtocolError(f"array {name!r} has a bad shape")
        specs.append((name, dtype, tuple(shape), math.prod(shape)))
    return specs


def _slice(specs: list[_Spec], payload: bytearray) -> dict[str, np.ndarray]:
    """Cut the payload into arrays as described; the sizes must add up exactly."""
    arrays, offset = {}, 0
    for name, dtype, shape, count in specs:
        if offset + count * dtype.itemsize > len(payload):
            raise ProtocolError(f"array {name!r} runs past the payload")
        arrays[name] = np.frombuffer(payload, dtype, count, offset).reshape(shape)
        offset += count * dtype.itemsize
    if offset != len(payload):
        raise ProtocolError("payload size does not match the arrays")
    return arrays


def _remember(cache: dict, key: Any, value: Any) -> None:
    """Store into a bounded cache (cleared when full: headers repeat, so it refills fast)."""
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _send_rest(sock: socket.socket, parts: list, sent: int) -> None:
    """Send whatever of `parts` the first sendmsg did not."""
    for part in parts:
        view = memoryview(part).cast("B")
        if sent >= len(view):
            sent -= len(view)
            continue
        sock.sendall(view[sent:])
        sent = 0
