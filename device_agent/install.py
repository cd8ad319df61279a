"""Download, verify, self-test and atomically activate assigned model versions.

Artifacts stay encrypted at rest (`artifacts/SHA256`, named by ciphertext digest). Each
model has an install pointer, `models/NAME.json`, with two slots: `active` (what serves)
and `previous` (kept for fallback). Activating a version is one atomic replace of that
file (written beside it, fsynced, renamed, directory fsynced), so a power cut at any
instant leaves the old pointer or the new one, and both name artifacts that were fully
downloaded and verified before the pointer could name them.

Before activation a self-test decrypts the artifact in memory, loads it in `runtime`
(MNN in a worker process, plaintext in a sealed memfd only), probes the backend configs
against the version's golden data and keeps the fastest config whose outputs match. A
version whose self-test fails is never activated; it is recorded under `failed` and not
tried again until its assignment changes.

A new version of a model this device serves already need not wait for every candidate:
it is loaded on the fleet's recommended config or else on the config its previous version
won with, and activates as soon as that passes the golden check (one load, not one per
candidate). When the previous version's pick was used, the slot says `probes_pending`: the
agent probes the other candidates while the new version serves, switches if one is
faster, and records the outcome here (`record_probes`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from contract import errors
from contract.assignment import GoldenArtifact, VerifiedModel
from contract.chunks import ChunkTable, unpack_keys
from contract.device_client import DeviceConnection
from contract.limits import MODEL_NAME  # a network name becomes a path
from device_agent import llm_install, model_install
from device_agent.chunk_store import ChunkStore, ChunkWrites, OpenedChunks
from device_agent.download import DiskFull, Downloads, IntegrityFailure
from device_agent.plaintext import Plaintext, from_artifact, from_chunks
from device_agent.state import (
    AgentError,
    DamagedKeySet,
    SelfTestFailed,
    StateDir,
    fsync_dir,
    read_json,
    write_json,
)

log = logging.getLogger("skiff.agent")

POINTER_SCHEMA = "skiff.install-pointer/v1"


_SLOT = (("version", int), ("variant", str), ("uid", str), ("artifact", str))
_SLOT_KEYS = {"active": _SLOT, "previous": _SLOT, "failed": (*_SLOT, ("reason", str))}


@dataclass
class InstallTimings:
    """Seconds spent in each step of one install (reported with its outcome)."""

    download_s: float = 0.0
    verify_s: float = 0.0
    self_test_s: float = 0.0
    downloaded_bytes: int = 0
    resumed_from: int = 0
    # Of downloaded_bytes, how many came from the blob store's presigned URL.
    url_bytes: int = 0
    # A chunked version: chunks downloaded, and chunks already held (shared with a kept
    # version), so not downloaded.
    chunks_fetched: int = 0
    chunks_held: int = 0


@dataclass
class InstallOutcome:
    """What happened to one assigned version: activated, already active, or failed."""

    model: str
    version: int
    variant: str
    result: str  # "activated", "active", "failed"
    reason: str = ""
    config: str = ""
    timings: InstallTimings = field(default_factory=InstallTimings)
    rollout: str = ""
    probes: list = field(default_factory=list)
    # Activated on the previous version's config: the other candidates are still to probe.
    probes_pending: bool = False
    # Whether this outcome is news (worth a report): a version that failed before and is
    # skipped again, or one already active, is not.
    new: bool = True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _slot(m: VerifiedModel, config: str, probes: list[dict]) -> dict:
    """Return the pointer entry of an installed version: what a later load needs, no secret."""
    golden = m.golden
    return {
        "version": m.version,
        "variant": m.variant,
        "uid": m.uid,
        "rollout": m.rollout,
        "artifact": m.ciphertext_sha256,
        "ciphertext_size": m.ciphertext_size,
        "plaintext_sha256": m.plaintext_sha256,
        "plaintext_size": m.plaintext_size,
        "associated_data": m.associated_data.decode(),
        # Wrapped to this device's key: useless without the private key set.
        "wrapped_data_key": _b64(m.wrapped_data_key),
        "golden": None
        if golden is None
        else {
            "artifact": golden.ciphertext_sha256,
            "plaintext_sha256": golden.plaintext_sha256,
            "plaintext_size": golden.plaintext_size,
            "associated_data": golden.associated_data.decode(),
        },
        "degraded": m.degraded,
        "pipeline": m.pipeline,
        # Installed as chunks (the chunk store holds them; the key list, encrypted under
        # the data key, is an artifact): no artifact file of its own. None: one artifact.
        "chunks": None
        if m.chunks is None or m.chunk_keys is None
        else {
            "table": m.chunks.to_manifest(),
            "keys": {
                "artifact": m.chunk_keys.ciphertext_sha256,
                "plaintext_sha256": m.chunk_keys.plaintext_sha256,
                "plaintext_size": m.chunk_keys.plaintext_size,
                "associated_data": m.chunk_keys.associated_data.decode(),
            },
        },
        # "llm": an MNN-LLM bundle (a tar), served by Generate; absent: a tensor model.
        "kind": "llm" if m.llm is not None else "model",
        "config": config,
        "probes": probes,
        "activated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def same_target(slot: dict | None, m: VerifiedModel) -> bool:
    """Return whether a pointer slot holds exactly the assigned artifact (and pipeline)."""
    return bool(slot) and (
        slot["uid"],
        slot["variant"],
        slot["artifact"],
        slot.get("pipeline"),
    ) == (m.uid, m.variant, m.ciphertext_sha256, m.pipeline)


# Failures that come back with the same bytes: not retried until the assignment changes.
DETERMINISTIC = ("self-test", "runtime")

# Called with (model name, pointer slot, loaded runtime.Model) when a version activates;
# the callee owns the model from then on.
Activated = Callable[[str, dict, object], None]


class Installer:
    """Installs verified assignments into a state directory.

    `unwrap(wrapped_data_key, version_uid)` returns a version's data key (in memory only).
    With `on_activated`, the model the self-test loaded is handed over to serve instead of
    being closed: the new version serves without loading twice.
    """

    def __init__(
        self,
        state: StateDir,
        unwrap: Callable[[bytes, str], bytes],
        on_activated: Activated | None = None,
    ) -> None:
        self._state = state
        self._unwrap = unwrap
        self.on_activated = on_activated
        self.downloads = Downloads(state.artifacts)
        self.chunks = ChunkStore(state.chunks)
        # What the installs in progress fetch (artifacts and chunks, by name), counted (two
        # installs may share one): a sweep keeps them although no slot names them yet.
        self._in_use: collections.Counter[str] = collections.Counter()

    # -- pointers -----------------------------------------------------------------------------

    def pointer_path(self, model: str) -> Path:
        """Return where `model`'s install pointer lives (the name is checked, not trusted)."""
        if not MODEL_NAME.fullmatch(model):
            raise IntegrityFailure(f"model name {model!r:.80} is not a valid name")
        return self._state.models / f"{model}.json"

    def pointer(self, model: str) -> dict:
        """Return `model`'s install pointer ({} if it has none)."""
        path = self.pointer_path(model)
        body = read_json(path) or {}
        if body and body.get("schema") != POINTER_SCHEMA:
            raise AgentError(f"{path}: unknown schema {body.get('schema')!r}")
        for name, needs in _SLOT_KEYS.items():
            slot = body.get(name)
            if slot is not None and (
                not isinstance(slot, dict) or any(not isinstance(slot.get(k), t) for k, t in needs)
            ):
                raise AgentError(f"{path}: damaged {name!r} slot: restore it or delete the file")
        return body

    def pointers(self) -> dict[str, dict]:
        """Return every model's install pointer, by model name."""
        out = {}
        for path in sorted(self._state.models.glob("*.json")):
            if MODEL_NAME.fullmatch(path.stem):
                out[path.stem] = self.pointer(path.stem)
            else:
                log.warning("ignoring %s: not an install pointer", path)
        return out

    def active(self) -> dict[str, tuple[int, str]]:
        """Return (version, variant) of each model's active slot."""
        return {
            name: (p["active"]["version"], p["active"]["variant"])
            for name, p in self.pointers().items()
            if p.get("active")
        }

    def _write_pointer(self, model: str, body: dict) -> None:
        write_json(self.pointer_path(model), {"schema": POINTER_SCHEMA, "model": model, **body})

    # -- install ------------------------------------------------------------------------------

    async def install(self, conn: DeviceConnection, m: VerifiedModel) -> InstallOutcome:
        """Bring `m` to active, or leave the current version serving and say why not."""
        current = self.pointer(m.model)
        if same_target(current.get("active"), m):
            return InstallOutcome(m.model, m.version, m.variant, "active", new=False)
        failed = current.get("failed") or {}
        if (
            failed.get("kind") in DETERMINISTIC  # the same bytes would fail again
            and failed.get("uid") == m.uid
            and failed.get("artifact") == m.ciphertext_sha256
        ):
            return InstallOutcome(
                m.model, m.version, m.variant, "failed", failed["reason"], new=False
            )
        timings = InstallTimings()
        held = [*_artifacts(m), *(c.hex() for c in (m.chunks.distinct() if m.chunks else ()))]
        self._in_use.update(held)
        try:
            return await self._install(conn, m, current, timings)
        finally:
            self._in_use.subtract(held)
            self._in_use += collections.Counter()  # drops the zero counts

    async def _install(
        self, conn: DeviceConnection, m: VerifiedModel, current: dict, timings: InstallTimings
    ) -> InstallOutcome:
        if m.llm is None:
            # The self-test's worker starts (Python, MNN) while the download runs.
            await asyncio.to_thread(_prewarm_worker)
        opened, writes = None, None  # a chunked version's chunks: opened, and being written
        try:
            if m.chunks is not None and m.chunk_keys is not None:
                opened, writes = await self._fetch_chunks(conn, m, timings)
            else:
                await self.downloads.fetch(
                    conn, m.ciphertext_sha256, m.ciphertext_size, timings, m.segment_sha256, m.url
                )
            if m.golden is not None:
                await self.downloads.fetch(
                    conn, m.golden.ciphertext_sha256, m.golden.ciphertext_size, None
                )
            previous_config = (current.get("active") or {}).get("config", "")
            model, config, probes, pending = await self._self_test(
                m, timings, previous_config, opened
            )
            if writes is not None:  # the chunks on the disk before a pointer may name them
                try:
                    await writes.kept()
                except BaseException:
                    model.close()
                    raise
        except (IntegrityFailure, SelfTestFailed, DiskFull, DamagedKeySet) as exc:
            self._write_pointer(
                m.model,
                {
                    **_without_schema(current),
                    "failed": {
                        "version": m.version,
                        "variant": m.variant,
                        "uid": m.uid,
                        "artifact": m.ciphertext_sha256,
                        "reason": str(exc),
                        # A bad download, a full disk or a damaged key set is tried
                        # again at the next sync; a failed self-test is not, until the
                        # assignment changes.
                        "kind": _failure_kind(exc),
                        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    },
                },
            )
            log.warning("%s v%d (%s) not installed: %s", m.model, m.version, m.variant, exc)
            return InstallOutcome(
                m.model, m.version, m.variant, "failed", str(exc), "", timings, m.rollout
            )
        finally:
            if writes is not None:  # nothing of this install is still written once it is over
                with contextlib.suppress(Exception):
                    await writes.kept()
        previous = current.get("active") or current.get("previous")
        slot = _slot(m, config, probes)
        if pending:
            slot["probes_pending"] = True
        try:
            self._write_pointer(m.model, {"active": slot, "previous": previous, "failed": None})
        except BaseException:
            model.close()
            raise
        if self.on_activated is not None:
            # Off the event loop: the swap may wait for a pipeline push in flight.
            await asyncio.to_thread(self.on_activated, m.model, slot, model)
        else:
            model.close()
        self.collect_garbage()
        log.info("%s v%d (%s) active on %s", m.model, m.version, m.variant, config)
        return InstallOutcome(
            m.model,
            m.version,
            m.variant,
            "activated",
            "",
            config,
            timings,
            m.rollout,
            probes,
            probes_pending=pending,
        )

    def record_probes(self, model: str, uid: str, config: str, results) -> bool:
        """Record the probe that finished while version `uid` served, if it is still active.

        `results` are the round's `runtime.ProbeResult`s; `config` the one serving now. A
        later load of this version starts on it. Returns whether the pointer changed.
        """
        current = self.pointer(model)
        active = current.get("active")
        if not active or active["uid"] != uid:
            return False
        probes = [model_install.probe_json(r) for r in results]
        active = {**active, "config": config, "probes": probes}
        active.pop("probes_pending", None)
        self._write_pointer(model, {**_without_schema(current), "active": active})
        return True

    def roll_back(self, model: str, reason: str) -> dict | None:
        """Make the previous version active again; the active one is recorded as failed.

        Returns the slot now active (None when no previous version is kept: nothing
        changes then). The failed version is not installed again until its assignment
        changes.
        """
        current = self.pointer(model)
        active, previous = current.get("active"), current.get("previous")
        if not active or not previous:
            return None
        failed = {
            **{k: active[k] for k in ("version", "variant", "uid", "artifact")},
            "reason": reason,
            "kind": "runtime",
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        self._write_pointer(model, {"active": previous, "previous": None, "failed": failed})
        log.warning(
            "%s v%d rolled back to v%d: %s", model, active["version"], previous["version"], reason
        )
        return previous

    def load(self, model: str, slot: dict):
        """Decrypt an installed version in memory and load it on its recorded config.

        Returns a `runtime.Model` running in a worker process, or for a language model a
        `runtime.llm.LlmWorker` (the caller closes it).
        """
        from runtime import Model  # deferred: `skiff agent status` never needs the runtime

        key = self._unwrap(base64.b64decode(slot["wrapped_data_key"]), slot["uid"])
        source = self._slot_plaintext(model, slot, key)
        if slot.get("kind") == "llm":
            return llm_install.load_bundle(source, slot.get("config", ""))
        plain = source.read()
        try:
            return Model.from_bytes(
                plain,
                config=slot.get("config") or None,
                isolation="worker",
                version=f"{model}:{slot['version']}",
            )
        finally:
            del plain

    def remove(self, model: str) -> None:
        """Stop serving a model that is no longer assigned (its pointer goes first)."""
        path = self.pointer_path(model)
        if path.exists():
            path.unlink()
            fsync_dir(path.parent)
            self.collect_garbage()
            log.info("%s removed: no longer assigned", model)

    def collect_garbage(self, assigned: set[str] | None = None) -> None:
        """Delete artifacts no pointer slot names, and partial downloads not `assigned`.

        Partial downloads of what is still assigned are kept, to be resumed.
        """
        keep = set(assigned or ()) | set(self._in_use)
        chunks_kept: set[bytes] = set()
        for p in self.pointers().values():
            for slot in (p.get("active"), p.get("previous")):
                if slot:
                    keep.add(slot["artifact"])
                    if slot.get("golden"):
                        keep.add(slot["golden"]["artifact"])
                    if slot.get("chunks"):
                        keep.add(slot["chunks"]["keys"]["artifact"])
                        chunks_kept |= set(_slot_table(slot).distinct())
        # Chunks are swept only when the caller says what is still assigned (the end of a
        # sync): a failed install's verified chunks stay for its next try, as a partial
        # download does. The chunks of an install in progress stay too (no slot names them
        # yet).
        if assigned is not None:
            chunks_kept |= {_chunk_id(a) for a in keep} - {b""}
            self.chunks.sweep(chunks_kept)
        for path in self._state.artifacts.iterdir():
            if path.suffix == ".part":
                if assigned is not None and path.stem not in keep:
                    path.unlink(missing_ok=True)
            elif path.name not in keep:
                path.unlink(missing_ok=True)

    # -- steps ---------------------------------------------------------------------------------

    def artifact_path(self, digest: str) -> Path:
        """Return where the artifact with this ciphertext digest is kept."""
        return self.downloads.artifact_path(digest)

    async def _fetch_chunks(
        self, conn: DeviceConnection, m: VerifiedModel, timings: InstallTimings
    ) -> tuple[OpenedChunks, ChunkWrites]:
        """Fetch a chunked version: its key list, then the chunks this device lacks.

        Return the fetched chunks opened as they arrived (in memory, for the self-test:
        decrypting them while the others are in flight takes that off the path after the
        download), and their writes to the chunk store, which go on meanwhile. Memory:
        the self-test holds the whole plaintext anyway (a model's bytes, or an LLM
        bundle's memfds, each chunk handed on and dropped as it is used).
        """
        assert m.chunks is not None and m.chunk_keys is not None
        started = time.monotonic()
        await self.downloads.fetch(
            conn, m.chunk_keys.ciphertext_sha256, m.chunk_keys.ciphertext_size, None
        )
        keys = await asyncio.to_thread(self._version_chunk_keys, m)
        opened = OpenedChunks(keys, m.model)
        wanted = set(m.chunks.distinct())
        writes = await self.chunks.fetch_missing(conn, m.chunks, opened)
        timings.download_s = time.monotonic() - started
        timings.downloaded_bytes = writes.bytes
        timings.chunks_fetched = writes.count
        timings.chunks_held = len(wanted) - writes.count
        return opened, writes

    def _version_chunk_keys(self, m: VerifiedModel) -> dict[bytes, bytes]:
        """Return the keys of an assigned chunked version's chunks (its key list, decrypted)."""
        assert m.chunks is not None and m.chunk_keys is not None
        key = self._unwrap(m.wrapped_data_key, m.uid)
        return self._chunk_keys(m.chunk_keys, key, m.chunks)

    def _plaintext(self, m: VerifiedModel, key: bytes, opened: OpenedChunks | None) -> Plaintext:
        """Return where the assigned variant's plaintext comes from (chunks or artifact)."""
        return self._slot_plaintext(m.model, _slot(m, "", []), key, opened)

    def _slot_plaintext(
        self, model: str, slot: dict, key: bytes, opened: OpenedChunks | None = None
    ) -> Plaintext:
        """Return where an installed slot's plaintext comes from (chunks or artifact).

        `opened`: the chunks this install fetched, opened as they arrived.
        """
        if slot.get("chunks"):
            stored = slot["chunks"]["keys"]
            ref = GoldenArtifact(
                ciphertext_sha256=stored["artifact"],
                ciphertext_size=0,
                plaintext_sha256=stored["plaintext_sha256"],
                plaintext_size=stored["plaintext_size"],
                segment_size=0,
                associated_data=stored["associated_data"].encode(),
            )
            table = _slot_table(slot)
            keys = self._chunk_keys(ref, key, table)
            return from_chunks(
                self.chunks,
                table,
                keys,
                model,
                slot["plaintext_sha256"],
                slot["plaintext_size"],
                opened,
            )
        return from_artifact(
            self.artifact_path(slot["artifact"]),
            key,
            slot["associated_data"].encode(),
            slot["plaintext_sha256"],
            slot["plaintext_size"],
        )

    def _chunk_keys(self, ref: GoldenArtifact, key: bytes, table: ChunkTable) -> dict[bytes, bytes]:
        """Decrypt a version's chunk key list (in memory only) and match it to its table."""
        packed = self._golden_bytes(ref, key)  # a small artifact under the data key, as golden
        try:
            return unpack_keys(packed, table)
        except errors.IntegrityError as exc:
            raise IntegrityFailure(str(exc)) from None

    async def _self_test(
        self,
        m: VerifiedModel,
        timings: InstallTimings,
        previous_config: str,
        opened: OpenedChunks | None = None,
    ) -> tuple:
        started = time.monotonic()
        try:
            return await asyncio.to_thread(self._self_test_blocking, m, previous_config, opened)
        finally:
            timings.self_test_s = time.monotonic() - started

    def _self_test_blocking(
        self, m: VerifiedModel, previous_config: str = "", opened: OpenedChunks | None = None
    ) -> tuple:
        """Load the version in a worker, probing configs against golden data.

        Returns (the loaded runtime.Model, its config key, the probe summaries, whether
        the other candidates are still to probe).
        """
        key = self._unwrap(m.wrapped_data_key, m.uid)
        source = self._plaintext(m, key, opened)
        golden = self._golden_bytes(m.golden, key) if m.golden is not None else None
        if m.llm is not None:
            worker, probes = llm_install.self_test(m, source, golden)
            return worker, worker.config.key, probes, False
        promote = self.on_activated is not None  # it serves as soon as it loads
        return model_install.self_test(m, source, golden, previous_config, promote=promote)

    def _golden_bytes(self, g: GoldenArtifact, key: bytes) -> bytes:
        return decrypt_artifact(
            self.artifact_path(g.ciphertext_sha256),
            key,
            g.associated_data,
            g.plaintext_sha256,
            g.plaintext_size,
        )


def decrypt_artifact(
    path: Path, key: bytes, associated_data: bytes, plaintext_sha256: str, plaintext_size: int
) -> bytes:
    """Decrypt an artifact into memory and check it against its signed digest and size."""
    return from_artifact(path, key, associated_data, plaintext_sha256, plaintext_size).read()


def _artifacts(m: VerifiedModel) -> list[str]:
    """Return the artifacts an install of `m` fetches (by ciphertext digest)."""
    names = [m.ciphertext_sha256]
    if m.golden is not None:
        names.append(m.golden.ciphertext_sha256)
    if m.chunk_keys is not None:
        names.append(m.chunk_keys.ciphertext_sha256)
    return names


def _chunk_id(name: str) -> bytes:
    """Return the chunk id a SHA-256 hex name would be (b"" for any other name)."""
    try:
        return bytes.fromhex(name) if len(name) == 64 else b""
    except ValueError:
        return b""


def _slot_table(slot: dict) -> ChunkTable:
    """Return an installed slot's chunk table (written by this agent from a signed one)."""
    try:
        return ChunkTable.from_manifest(slot["chunks"]["table"], slot["plaintext_size"])
    except errors.IntegrityError as exc:
        raise AgentError(f"damaged chunk table in an install pointer: {exc}") from None


def _failure_kind(exc: Exception) -> str:
    if isinstance(exc, SelfTestFailed):
        return "self-test"
    if isinstance(exc, DamagedKeySet):
        return "device-key"
    return "disk" if isinstance(exc, DiskFull) else "integrity"


def _prewarm_worker() -> None:
    from runtime import prewarm_worker  # deferred: `skiff agent status` never needs the runtime

    try:
        prewarm_worker()
    except OSError as exc:  # only a head start: the self-test starts its worker itself
        log.info("could not start a worker ahead of the self-test: %s", exc)


def _without_schema(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("schema", "model")}
