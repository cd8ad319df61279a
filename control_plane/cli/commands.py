"""What each CLI command does; `cli.py` only parses arguments and dispatches here.

Each start_* function returns (json_value, text) for the CLI to print, or None.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from contract import errors
from control_plane.api.transfer import read_pipeline
from control_plane.api.trust import verify_version
from control_plane.cli import views
from control_plane.cli.connect import admin_client as _client
from control_plane.cli.golden_flags import push_options
from control_plane.cli.listing import limit_of, listed, say_more
from control_plane.cli.progress import ProgressBar
from control_plane.cli.push_views import push_text
from control_plane.cli.signing_commands import trusted_pins
from control_plane.registry.requests import parse_ref
from control_plane.settings import Config

Output = tuple[object, str] | None


def start_init(*, config: Config, args: argparse.Namespace) -> Output:
    """Create the embedded default."""
    from control_plane.home import init_home  # the server's store: not for client commands

    made = init_home(config, tls_names=args.tls_san)
    body = {k: str(v) for k, v in made.__dict__.items()}
    text = (
        f"initialised {made.home}\n"
        f"  database  {made.db}\n  blobs     {made.blobs}\n  kek       {made.kek}\n"
        f"  TLS       {made.tls_cert}\n"
        f"  clients trust the CA {made.tls_ca or '(your own)'} (copy it; --ca or SKIFF_CA)\n"
        f"  admin token written to {made.token_file} (mode 0600)\n"
        f"next: skiff server --home {made.home}"
    )
    return body, text


def start_server(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the control plane until interrupted."""
    from control_plane.serve import serve

    status = serve(
        config=config, replica=args.replica, workers=args.workers, worker_index=args.worker_index
    )
    if status:
        raise SystemExit(status)
    return None


def start_model_push(*, config: Config, args: argparse.Namespace) -> Output:
    """Upload a model file as the next version."""
    pipeline = read_pipeline(args.pipeline) if args.pipeline is not None else None
    with contextlib.ExitStack() as stack:
        path, filename = args.file, None
        if args.file.is_dir():  # an MNN-LLM bundle, as MNN's exporter writes it
            path, filename = stack.enter_context(_bundle_tar(args.file))
        bar = ProgressBar(f"push {filename or args.file.name}", after="  - server validating")
        with _client(config) as client:
            try:
                version = client.push(
                    path,
                    name=args.name,
                    notes=args.notes,
                    progress=bar,
                    pipeline=pipeline,
                    filename=filename,
                    **push_options(args),
                )
            finally:  # a failed or cancelled push's message starts on a line of its own
                bar.finish()
    return views.version_dict(version), push_text(version)


@contextlib.contextmanager
def _bundle_tar(directory: Path) -> Iterator[tuple[Path, str]]:
    """Pack a bundle directory into the canonical tar, in memory; yield its path and name.

    A memfd, not a file: the bundle is plaintext, and a copy of it has no business on
    disk. It holds the whole bundle in memory while the push runs.
    """
    from runtime.llm.bundle import InvalidBundle, write_bundle_tar

    fd = os.memfd_create("skiff-bundle", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as out:
            try:
                write_bundle_tar(directory, out)
            except InvalidBundle as exc:
                raise errors.InvalidArgument(f"{directory}: {exc}") from None
            except OSError as exc:
                raise errors.InvalidArgument(f"cannot read {directory}: {exc.strerror}") from None
        yield Path(f"/proc/self/fd/{fd}"), f"{directory.name}.tar"
    finally:
        os.close(fd)


def start_model_ls(*, config: Config, args: argparse.Namespace) -> Output:
    """List models (all of them, page by page, unless --limit)."""
    limit = limit_of(args)
    with _client(config) as client:
        page = client.models_page(limit)
    more = bool(page.next_page_token)
    say_more(more, "models", limit)
    body = listed("models", [views.model_dict(m) for m in page.models], more=more)
    return body, views.models_table(list(page.models))


def _backends(config: Config, name: str, number: int | None) -> Output:
    if number is None:
        raise errors.InvalidArgument(f"--backends needs a version: {name}:N")
    from control_plane.cli import fleet_views

    with _client(config) as client:
        found = client.get_backends(name, number)
    tables = [fleet_views.backends_dict(t) for t in found.classes]
    text = fleet_views.backends_text(name, number, found.classes)
    return {"model": name, "version": number, "classes": tables}, text


def start_model_show(*, config: Config, args: argparse.Namespace) -> Output:
    """Show one model's versions (all, page by page, unless --limit), or one version."""
    name, number = parse_ref(args.ref)
    if args.backends:
        return _backends(config, name, number)
    limit = limit_of(args)
    with _client(config) as client:
        found = client.get_model(name, number, limit=limit)
        try:
            pins = trusted_pins(config, client)
        except errors.FailedPrecondition:
            pins = None
    say_more(bool(found.next_page_token), "versions", limit)
    versions, texts = [], []
    for v in found.versions:
        body = views.version_dict(v)
        if pins is None:
            signed_by, reason = "", "no pinned signing keys (run `skiff key pin`)"
        else:
            try:
                signed_by, reason = verify_version(pins, v, model=name, number=v.version).key_id, ""
            except errors.IntegrityError as exc:
                signed_by, reason = "", str(exc)
        body["signature_verified"] = bool(signed_by)
        body["signed_by"] = signed_by or None
        if reason:
            body["signature_error"] = reason
        versions.append(body)
        texts.append(views.version_text(v, signed_by=signed_by, unverified=reason))
    body = {
        "model": views.model_dict(found.model),
        **listed("versions", versions, more=bool(found.next_page_token)),
    }
    return body, "\n".join(texts)


def start_model_pull(*, config: Config, args: argparse.Namespace) -> Output:
    """Download and verify a decrypted model."""
    name, number = parse_ref(args.ref)
    with _client(config) as client:
        pins = trusted_pins(config, client)
        bar = ProgressBar(f"pull {args.ref}")
        header = client.pull(
            name,
            number,
            args.output,
            pins=pins,
            variant=args.variant,
            progress=bar,
            golden=args.golden,
        )
    bar.finish()
    v, var = header.version, header.variant
    signed_by = verify_version(pins, v, model=name, number=number).key_id  # checked by pull
    what, size, digest = var.name, var.plaintext_size, var.plaintext_sha256
    if args.golden:
        what, size, digest = "golden", v.golden.plaintext_size, v.golden.plaintext_sha256
    body = {
        "model": v.model,
        "version": v.version,
        "variant": what,
        "path": str(args.output.resolve()),
        "size": size,
        "sha256": digest,
        "signature_verified": True,
        "signed_by": signed_by,
    }
    return body, (
        f"wrote {v.model}:{v.version} ({what}, {size:,} bytes) to "
        f"{args.output}, verified against its manifest signed by {signed_by}"
    )


def start_key_rotate(*, config: Config, args: argparse.Namespace) -> Output:
    """Re-wrap every data key under a new key-encryption key."""
    with _client(config) as client:
        r = client.rotate_kek(args.to)
    body = {"old_kek_id": r.old_kek_id, "new_kek_id": r.new_kek_id, "rewrapped": r.rewrapped}
    return body, f"re-wrapped {r.rewrapped} data keys: {r.old_kek_id} -> {r.new_kek_id}"


def start_gc(*, config: Config, args: argparse.Namespace) -> Output:
    """Collect unreferenced blobs (or list them with --dry-run)."""
    with _client(config) as client:
        r = client.collect_garbage(dry_run=args.dry_run)
    body = {
        "dry_run": args.dry_run,
        "blobs": list(r.blobs),
        "bytes": r.bytes,
        "kept_young": r.kept_young,
    }
    verb = "would delete" if args.dry_run else "deleted"
    lines = [f"{verb} {len(r.blobs)} unreferenced blobs ({r.bytes:,} bytes)"]
    lines += [f"  {key}" for key in r.blobs]
    if r.kept_young:
        lines.append(f"kept {r.kept_young} younger than the grace period (a push may own them)")
    return body, "\n".join(lines)


def start_demo(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the end-to-end demo."""
    from control_plane.demo.walkthrough import run_demo

    run_demo(home=args.home, real_models=args.real_models)
    return None
