"""Tables and text for people about devices, rollouts and API tokens.

What the CLI prints without `--json`, and the demo's story: the figures come from the
documents of control_plane.views.fleet (the JSON the same commands print), so the words
and the numbers cannot disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from control_plane.rollouts.lifecycle import paused_text as paused_words
from control_plane.views.fleet import device_dict, fit_dict, iso_or_none
from protos import fleet_pb2

if TYPE_CHECKING:
    from rich.table import Table


def _models(states: dict) -> str:
    return ", ".join(f"{m}:{s['version']}" for m, s in states.items()) or "-"


def devices_table(
    devices: list[fleet_pb2.Device], *, misfits=None, previewed: str = ""
) -> Table | str:
    """Render devices as a table; with a fit preview (`misfits`), a FIT column and totals."""
    if not devices:
        return "no devices match"
    from rich.console import Group
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    columns = ["ID", "PLATFORM", "MODEL", "SOC", "REGION", "ONLINE", "DESIRED", "INSTALLED"]
    for col in columns + (["FIT"] if misfits is not None else []):
        table.add_column(col)
    for d in devices:
        body = device_dict(d)
        a = body["attributes"]
        row = [
            d.id,
            a.get("platform", "-"),
            a.get("device_model", "-"),
            a.get("soc", "-"),
            a.get("region", "-"),
            "revoked" if d.revoked else ("yes" if d.online else "no"),
            _models(body["desired"]),
            _models(body["installed"]),
        ]
        if misfits is not None:
            why = misfits.get(d.id)
            row.append("fits" if why is None else f"no: {why.detail}")
        table.add_row(*row)
    if misfits is None:
        return table
    totals = fit_dict(previewed, devices, misfits)
    reasons = ", ".join(f"{k} {n}" for k, n in totals["ineligible_reasons"].items())
    line = f"{previewed}: {totals['fits']} of {len(devices)} listed devices fit"
    if totals["ineligible"]:
        line += f"; ineligible {totals['ineligible']} ({reasons})"
    return Group(table, line)


def device_text(d: fleet_pb2.Device) -> str:
    """Describe one device for people, with its recent installs and latency per model."""
    body = device_dict(d, telemetry=True)
    attested = _attributes_text(body["attested"])
    lines = [
        d.id + ("  (revoked)" if d.revoked else ""),
        f"  attributes  {_attributes_text(body['attributes']) or '-'}",
        "  attested    " + (f"{attested}  (stamped by its enrollment token)" if attested else "-"),
        f"  enrolled    {body['enrolled_at']}",
        f"  last seen   {body['last_seen'] or '-'}  online: {'yes' if d.online else 'no'}",
        f"  desired     {_desired_text(body['desired'])}",
        f"  synced      {_models(body['synced'])}",
        f"  installed   {_models(body['installed'])}",
    ]
    offset = body["clock_offset_s"]
    if offset is not None and abs(offset) >= CLOCK_NOTE_S:
        lines.append(f"  clock       {_offset_text(offset)} (times it reports are corrected)")
    if body["reports_refused"]:
        lines.append(
            f"  refused     {body['reports_refused']} report batches, not counted; latest at"
            f" {body['last_refusal_at']}: {body['last_refusal']}"
        )
    if body["latency"]:
        lines.append("  latency (recent reports)")
        for x in body["latency"]:
            p = [_us(x[k]) for k in ("p50_us", "p95_us", "p99_us")]
            lines.append(
                f"    {x['model']}:{x['version']} ({x['variant']}, {x['config'] or '-'})"
                f"  p50 {p[0]}  p95 {p[1]}  p99 {p[2]}  runs {x['inferences']}"
                f"  errors {x['errors']}  crashes {x['crashes']}"
                + (f"  pipeline firings {x['pipeline_firings']}" if x["pipeline_firings"] else "")
            )
    if body["recent_installs"]:
        lines.append("  recent installs")
        for i in body["recent_installs"]:
            t = i["timings"]
            took = (
                f"  download {t['download_s']:.2f}s  self-test {t['self_test_s']:.2f}s"
                if i["result"] == "activated"
                else ""
            )
            why = f"  ({i['reason']})" if i["reason"] else ""
            lines.append(f"    {i['at']}  {i['model']}:{i['version']}  {i['result']}{took}{why}")
    return "\n".join(lines)


# A device clock this far off the control plane's is worth a line in `fleet show`.
CLOCK_NOTE_S = 300.0


def _offset_text(offset_s: float) -> str:
    way = "ahead of" if offset_s > 0 else "behind"
    size = abs(offset_s)
    amount = f"{size / 3600:.1f} h" if size >= 3600 else f"{size:.0f} s"
    return f"{amount} {way} the control plane's"


def _attributes_text(attrs: dict) -> str:
    parts = [f"{k}={v}" for k, v in attrs.items() if k not in ("tags", "custom")]
    if "tags" in attrs:
        parts.append(f"tags={','.join(attrs['tags'])}")
    parts += [f"custom.{k}={v}" for k, v in attrs.get("custom", {}).items()]
    return ", ".join(parts)


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f}ms" if value >= 1000 else f"{value:.0f}us"


def _desired_text(desired: dict) -> str:
    parts = [f"{m}:{x['version']} ({x['variant']}, {x['rollout']})" for m, x in desired.items()]
    return ", ".join(parts) or "-"


def _health_lines(r: fleet_pb2.Rollout) -> list[str]:
    if not r.halt_rules and not r.HasField("health"):
        return []
    lines = [
        f"  guardrails  {', '.join(r.halt_rules) or '(no halt rules)'}"
        f"  min {r.min_devices} devices, {r.min_inferences} inferences"
        + (f"  sliced by {r.slice_by}" if r.slice_by else "")
    ]
    if not r.HasField("health"):
        return lines
    h = r.health
    lines.append(f"  health since {iso_or_none(h.since)}   candidate vs baseline")
    for s in [h.overall, *h.slices]:
        c, b = s.candidate, s.baseline
        label = s.slice or "(all)"

        def p95(x):
            return f"{x.p95_us:,.0f}" if x.HasField("p95_us") else "-"

        lines.append(
            f"    {label:<24} {s.state:<11} devices {c.devices}/{b.devices}"
            f"  inferences {c.inferences}/{b.inferences}  p95 {p95(c)}/{p95(b)} us"
            f"  crashes {c.crashes}/{b.crashes}"
        )
        if c.ttft_count or b.ttft_count or c.tokens_out or b.tokens_out:
            lines.append(f"    {'':<24} {'':<11} {_llm_pair(c, b)}")
        for v in s.rules:
            lines.append(f"      {v.rule:<26} {v.sentence or f'{v.detail}: {v.status}'}")
    if h.outside_reports:
        lines.append(
            f"    outside the cohorts: {h.outside_reports} reports from {h.outside_devices}"
            " devices (not what they were assigned: kept, never judged)"
        )
    return lines


def _llm_pair(c: fleet_pb2.CohortFigures, b: fleet_pb2.CohortFigures) -> str:
    """Say a language model's figures, candidate/baseline: decode speed, TTFT, tokens."""

    def tps(x):
        return f"{x.decode_tps:,.1f}" if x.HasField("decode_tps") else "-"

    def ttft(x):
        return f"{x.ttft_p95_ms:,.0f}" if x.HasField("ttft_p95_ms") else "-"

    return (
        f"decode {tps(c)}/{tps(b)} tokens/s  ttft p95 {ttft(c)}/{ttft(b)} ms"
        f"  tokens out {c.tokens_out}/{b.tokens_out}  cancelled {c.cancellations}/{b.cancellations}"
    )


def _stages(r: fleet_pb2.Rollout) -> str:
    return " ".join(
        (f"[{s:g}%]" if i == r.stage else f"{s:g}%") for i, s in enumerate(r.stages, start=1)
    )


def stage_text(stage: int, stages) -> str:
    """Describe stage `stage` (numbered from 1) of `stages`: "stage 2 of 3 (50%)"."""
    if not 1 <= stage <= len(stages):
        return f"stage {stage} of {len(stages)}"
    return f"stage {stage} of {len(stages)} ({stages[stage - 1]:g}%)"


def paused_text(r: fleet_pb2.Rollout) -> str:
    """Say what a paused rollout does, the same words on every surface (and how to resume)."""
    if not 1 <= r.stage <= len(r.stages):
        return f"it stays where it is until resumed (`skiff rollout resume {r.id}`)"
    return f"{paused_words(r.stage - 1, r.stages)} (`skiff rollout resume {r.id}`)"


def transition_text(r: fleet_pb2.Rollout, action: str, piece: str = "") -> str:
    """Say what a pause, resume, promote or rollback (of a slice) left the rollout as."""
    where = stage_text(r.stage, r.stages)
    if piece:
        done = "readmitted" if action == "resume" else "rolled back"
        return f"{r.id}: slice {piece} {done}; the rollout is {r.state} at {where}"
    if r.state == "paused":
        return f"{r.id}: paused: {paused_text(r)}"
    if r.state == "rolled_back":
        return f"{r.id}: rolled back: every device it moved returns to what it ran without it"
    if r.state == "completed":
        return f"{r.id}: completed: every selected device gets {r.model}:{r.version} ({where})"
    if action == "resume":
        return f"{r.id}: active again at {where}; the stage's bake time starts over"
    return f"{r.id}: active at {where}"


def _devices(n: int) -> str:
    return f"{n} device" + ("" if n == 1 else "s")


def preview_text(r: fleet_pb2.Rollout) -> str:
    """Describe a dry run for people: devices per stage and per slice; nothing was created."""
    p = r.preview
    what = f"{r.model}:{r.version} ({r.variant})" + ("  DEGRADED" if r.degraded else "")
    lines = [
        f"dry run: nothing created. {what} to {r.selector or '(whole fleet)'} would select "
        f"{_devices(p.selected)} today"
    ]
    if not p.selected and r.selector:
        lines.append("  it matches no device: `rollout create` needs --allow-empty for it")
    for i, (pct, n) in enumerate(zip(r.stages, p.devices, strict=True), start=1):
        lines.append(f"  stage {i} of {len(r.stages)} ({pct:g}%)  {_devices(n)}")
    if p.slices:
        lines.append(f"  per slice ({r.slice_by}), stage by stage")
        for s in p.slices:
            lines.append(f"    {s.slice:<28} {' / '.join(str(n) for n in s.devices)}")
        if p.more_slices:
            lines.append(f"    and {p.more_slices} smaller slices")
    if len(r.stages) > 1:
        lines.append(
            "  (stages before the last are a sticky sample the rollout draws when created: "
            "expect about these counts)"
        )
    return "\n".join(lines)


def rollouts_table(rollouts: list[fleet_pb2.Rollout]) -> Table | str:
    """Render rollouts as a table."""
    if not rollouts:
        return "no rollouts yet: create one with `skiff rollout create NAME:VERSION`"
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("ID", "MODEL", "VARIANT", "STATE", "STAGES", "PRIORITY", "SELECTOR"):
        table.add_column(col)
    for r in rollouts:
        table.add_row(
            r.id,
            f"{r.model}:{r.version}",
            r.variant,
            r.state,
            _stages(r),
            str(r.priority),
            r.selector or "(whole fleet)",
        )
    return table


def degraded_how(r: fleet_pb2.Rollout) -> str:
    """Say how a rollout of a degraded variant came to be (CLI and dashboard)."""
    if r.degraded_allowed:
        return "rolled out with --allow-degraded"
    return "created before --allow-degraded was required"


def rollout_text(r: fleet_pb2.Rollout) -> str:
    """Describe one rollout for people, with its counts and audit log."""
    c = r.counts
    lines = [f"{r.id}  {r.model}:{r.version} ({r.variant})  {r.state}"]
    if r.degraded:
        lines.append(f"  variant   {r.variant} DEGRADED ({r.degraded_reason}): {degraded_how(r)}")
    if r.state == "paused":
        lines.append(f"  paused    {paused_text(r)}")
    lines += [
        f"  selector  {r.selector or '(whole fleet)'}",
        f"  stage     {stage_text(r.stage, r.stages)}   {_stages(r)}  bake {r.bake_s}s"
        f"  priority {r.priority}",
        f"  devices   selected {c.selected}  in stage {c.in_stage}  synced {c.synced}"
        f"  installed {c.installed}  failed {c.failed}{_ineligible(c)}{_waiting(c)}",
        *_download_lines(r),
        *_health_lines(r),
        "  audit",
    ]
    for e in r.audit:
        change = f"{e.from_state} -> {e.to_state}" if e.from_state else e.to_state
        if e.slice:
            change = f"{e.slice}: {change}"
        why = f"  ({e.reason})" if e.reason else ""
        where = stage_text(e.stage, r.stages)
        lines.append(f"    {iso_or_none(e.at)}  {e.actor:<10} {e.action:<8} {change}, {where}{why}")
    return "\n".join(lines)


def api_tokens_table(tokens) -> Table | str:
    """Render API tokens as a table."""
    if not tokens:
        return "no API tokens"
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "ROLE", "CREATED", "BY", "EXPIRES", "REVOKED"):
        # Ids are what `token revoke` takes: never cut them to fit a narrow terminal.
        table.add_column(col, no_wrap=col == "ID", min_width=16 if col == "ID" else None)
    for t in tokens:
        table.add_row(
            t.id,
            t.name,
            t.role,
            _minute(t.created_at),
            t.created_by or "-",
            _minute(t.expires_at) or "never",
            _minute(t.revoked_at) or "-",
        )
    return table


def _minute(ts) -> str | None:
    if not ts.seconds and not ts.nanos:
        return None
    return ts.ToDatetime().strftime("%Y-%m-%d %H:%M")


def backends_text(name: str, version: int, classes) -> str:
    """Describe a version's backend tables for people."""
    if not classes:
        return f"{name}:{version}: no telemetry yet (devices report every minute or so)"
    lines = [f"{name}:{version}  backend configs by device class (last 7 days)"]
    for t in classes:
        who = ", ".join(f"{k}={v or '?'}" for k, v in sorted(t.device_class.items()))
        lines.append(f"  {t.variant}  {who}")
        for c in t.configs:
            mark = "*" if c.config == t.recommended else " "
            p50 = f"{c.p50_us:,.0f}" if c.HasField("p50_us") else "-"
            p95 = f"{c.p95_us:,.0f}" if c.HasField("p95_us") else "-"
            crash = f"{c.crash_rate:.2g}" if c.HasField("crash_rate") else "-"
            fallback = f"{c.fallback_rate:.2g}" if c.HasField("fallback_rate") else "-"
            note = f"  ({c.why})" if c.why else ""
            lines.append(
                f"   {mark} {c.config:<28} devices {c.devices:>6,}  samples {c.samples:>10,}"
                f"  p50 {p50:>8} us"
                f"  p95 {p95:>8} us  crashes {crash}  fallbacks {fallback}{note}"
            )
    lines.append("  * recommended")
    return "\n".join(lines)


def _waiting(c) -> str:
    """Say how many devices wait for Wi-Fi or a charger, and for which ("" when none)."""
    if not c.waiting:
        return ""
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(c.waiting_reasons.items()))
    return f"  waiting {c.waiting} ({why})"


def _download_lines(r: fleet_pb2.Rollout) -> list[str]:
    """Say what a device downloads (from each earlier version), and when it may."""
    lines = []
    if r.download_bytes:
        froms = [
            f"from v{v} {_mb(n)}" for v, n in sorted(r.download_bytes_from.items(), reverse=True)
        ]
        lines.append(f"  download  {_mb(r.download_bytes)} per device; " + ", ".join(froms))
        if not froms:
            lines[-1] = lines[-1].removesuffix("; ")
    on, during = r.download_on or "any", r.download_while or "any"
    if on != "any" or during != "any":
        parts = [f"on {on}" if on != "any" else "", "while charging" if during != "any" else ""]
        lines.append(f"  policy    downloads {', '.join(p for p in parts if p)}")
    return lines


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n:,} B"


def _ineligible(c) -> str:
    """Say how many selected devices cannot run the variant, and why ("" when none)."""
    if not c.ineligible:
        return ""
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(c.ineligible_reasons.items()))
    return f"  ineligible {c.ineligible} ({why})"
