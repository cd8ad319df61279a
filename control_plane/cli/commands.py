"""What each CLI command does; `cli.py` only parses arguments and dispatches here.

Each start_* function returns (json_value, text) for the CLI to print, or None.
"""

from __future__ import annotations

import argparse

from control_plane import errors
from control_plane.api.client import AdminClient
from control_plane.api.trust import verify_version
from control_plane.cli import views
from control_plane.cli.progress import ProgressBar
from control_plane.cli.signing_commands import trusted_pins
from control_plane.home import init_home, read_token
from control_plane.registry.registry import parse_ref
from control_plane.settings import Config

Output = tuple[object, str] | None


def _client(config: Config) -> AdminClient:
    return AdminClient(config.dial_address, read_token(config.home))


def start_init(*, config: Config, args: argparse.Namespace) -> Output:
    """Create the embedded default."""
    made = init_home(config)
    body = {k: str(v) for k, v in made.__dict__.items()}
    text = (
        f"initialised {made.home}\n"
        f"  database  {made.db}\n  blobs     {made.blobs}\n  kek       {made.kek}\n"
        f"  admin token written to {made.token_file} (mode 0600)\n"
        f"next: skiff server --home {made.home}"
    )
    return body, text


def start_server(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the control plane until interrupted."""
    from control_plane.api.server import serve

    serve(config=config)
    return None


def start_model_push(*, config: Config, args: argparse.Namespace) -> Output:
    """Upload a model file as the next version."""
    bar = ProgressBar(f"push {args.file.name}", after="  - server validating with MNN")
    with _client(config) as client:
        version = client.push(
            args.file, name=args.name, notes=args.notes, variants=tuple(args.variant), progress=bar
        )
    bar.finish()
    return views.version_dict(version), f"{version.model}:{version.version}"


def start_model_ls(*, config: Config, args: argparse.Namespace) -> Output:
    """List models."""
    with _client(config) as client:
        models = client.list_models()
    return [views.model_dict(m) for m in models], views.models_table(models)


def start_model_show(*, config: Config, args: argparse.Namespace) -> Output:
    """Show one model's versions, or one version."""
    name, number = parse_ref(args.ref)
    with _client(config) as client:
        found = client.get_model(name, number)
        try:
            pins = trusted_pins(config, client)
        except errors.FailedPrecondition:
            pins = None
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
    return {"model": views.model_dict(found.model), "versions": versions}, "\n".join(texts)


def start_model_pull(*, config: Config, args: argparse.Namespace) -> Output:
    """Download and verify a decrypted model."""
    name, number = parse_ref(args.ref)
    with _client(config) as client:
        pins = trusted_pins(config, client)
        bar = ProgressBar(f"pull {args.ref}")
        header = client.pull(
            name, number, args.output, pins=pins, variant=args.variant, progress=bar
        )
    bar.finish()
    v, var = header.version, header.variant
    signed_by = verify_version(pins, v, model=name, number=number).key_id  # checked by pull
    body = {
        "model": v.model,
        "version": v.version,
        "variant": var.name,
        "path": str(args.output.resolve()),
        "size": var.plaintext_size,
        "sha256": var.plaintext_sha256,
        "signature_verified": True,
        "signed_by": signed_by,
    }
    return body, (
        f"wrote {v.model}:{v.version} ({var.name}, {var.plaintext_size:,} bytes) to "
        f"{args.output}, verified against its manifest signed by {signed_by}"
    )


def start_key_rotate(*, config: Config, args: argparse.Namespace) -> Output:
    """Re-wrap every data key under a new key-encryption key."""
    with _client(config) as client:
        r = client.rotate_kek(args.to)
    body = {"old_kek_id": r.old_kek_id, "new_kek_id": r.new_kek_id, "rewrapped": r.rewrapped}
    return body, f"re-wrapped {r.rewrapped} data keys: {r.old_kek_id} -> {r.new_kek_id}"


def start_demo(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the end-to-end demo."""
    from control_plane.demo.walkthrough import run_demo

    run_demo(home=args.home)
    return None
