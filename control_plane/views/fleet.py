"""The JSON documents of devices, rollouts, backend tables and API tokens.

One function per document, from the API's messages: what `skiff ... --json` prints, what
the dashboard's pages and `/api/v1` show, and what /metrics counts, so a figure is
mapped to its JSON name in one place whichever surface shows it.
"""

from __future__ import annotations

import json

from contract.attribute_messages import attributes_dict as wire_attributes
from protos import fleet_pb2


def iso_or_none(ts) -> str | None:
    """Return a Timestamp to the second in ISO 8601 with Z, or None when it is unset."""
    if not ts.seconds and not ts.nanos:
        return None
    return ts.ToDatetime().replace(microsecond=0).isoformat() + "Z"


def attributes_dict(msg) -> dict:
    """Return the attributes of a DeviceAttributes message as documents show them.

    The wire's own reading (contract.attribute_messages), tidied for people and diffs: no empty
    tag set, tags and custom keys sorted.
    """
    raw = wire_attributes(msg)
    out = {k: v for k, v in raw.items() if k not in ("tags", "custom")}
    if raw["tags"]:
        out["tags"] = sorted(raw["tags"])
    if raw.get("custom"):
        out["custom"] = dict(sorted(raw["custom"].items()))
    return out


def _states(items) -> dict:
    return {s.model: {"version": s.version, "variant": s.variant} for s in items}


def device_dict(d: fleet_pb2.Device, *, telemetry: bool = False) -> dict:
    """JSON-ready form of a device (the shape `skiff sim --json` prints too).

    `attested` holds the attributes its enrollment token stamped (a part of `attributes`,
    with the same values; {} when none), the ones `@key` selector clauses match.
    With `telemetry` (`fleet show`), also its recent install outcomes and latency.
    """
    body = {
        "id": d.id,
        "attributes": attributes_dict(d.attributes),
        "attested": attributes_dict(d.attested),
        "enrolled_at": iso_or_none(d.enrolled_at),
        "last_seen": iso_or_none(d.last_seen),
        "online": d.online,
        "revoked": d.revoked,
        "installed": _states(d.installed),
        "synced": _states(d.synced),
        "desired": {
            m: {"version": x.version, "variant": x.variant, "rollout": x.rollout}
            for m, x in sorted(d.desired.items())
        },
        "reports_refused": d.reports_refused,
        "last_refusal": d.last_refusal or None,
        "last_refusal_at": iso_or_none(d.last_refusal_at),
        "clock_offset_s": d.clock_offset_s if d.HasField("clock_offset_s") else None,
    }
    if telemetry:
        body["recent_installs"] = [install_dict(i) for i in d.recent_installs]
        body["latency"] = [latency_dict(x) for x in d.latency]
    return body


def device_fit(why) -> dict:
    """Return one device's fit (a DeviceMisfit, or None when it fits), JSON-able."""
    if why is None:
        return {"fits": True, "reason": None, "detail": None}
    return {"fits": False, "reason": why.reason, "detail": why.detail}


def fit_dict(previewed: str, devices, misfits) -> dict:
    """Return a fit preview's totals: how many listed devices fit, and why the rest do not."""
    reasons: dict[str, int] = {}
    for d in devices:
        why = misfits.get(d.id)
        if why is not None:
            reasons[why.reason] = reasons.get(why.reason, 0) + 1
    return {
        "version": previewed,
        "fits": len(devices) - sum(reasons.values()),
        "ineligible": sum(reasons.values()),
        "ineligible_reasons": dict(sorted(reasons.items())),
    }


def install_dict(i) -> dict:
    """JSON-ready form of one reported install outcome."""
    return {
        "at": iso_or_none(i.at),
        "model": i.model,
        "version": i.version,
        "variant": i.variant,
        "rollout": i.rollout,
        "result": i.result,
        "reason": i.reason,
        "config": i.config,
        "timings": {
            "download_s": round(i.download_s, 4),
            "verify_s": round(i.verify_s, 4),
            "self_test_s": round(i.self_test_s, 4),
            "downloaded_bytes": i.downloaded_bytes,
            "resumed_from": i.resumed_from,
            "url_bytes": i.url_bytes,
        },
    }


def latency_dict(x) -> dict:
    """JSON-ready form of one model version's latency on a device."""

    def pct(name: str) -> float | None:
        return round(getattr(x, name), 1) if x.HasField(name) else None

    return {
        "model": x.model,
        "version": x.version,
        "variant": x.variant,
        "config": x.config,
        "inferences": x.inferences,
        "errors": x.errors,
        "crashes": x.crashes,
        "pipeline_firings": x.pipeline_firings,
        "p50_us": pct("p50_us"),
        "p95_us": pct("p95_us"),
        "p99_us": pct("p99_us"),
        "since": iso_or_none(x.since),
    }


def rollout_dict(r: fleet_pb2.Rollout) -> dict:
    """JSON-ready form of a rollout.

    `stage` (and each audit entry's) is numbered from 1: stage N is `stages[N - 1]`.
    """
    return {
        "id": r.id,
        "model": r.model,
        "version": r.version,
        "variant": r.variant,
        "selector": r.selector,
        "stages": [float(s) for s in r.stages],
        "stage": r.stage,
        "state": r.state,
        "bake_s": r.bake_s,
        "priority": r.priority,
        "download_on": r.download_on or "any",
        "download_while": r.download_while or "any",
        "download_bytes": r.download_bytes or None,
        "download_bytes_from": {str(k): v for k, v in sorted(r.download_bytes_from.items())},
        "degraded": r.degraded,
        "degraded_reason": r.degraded_reason or None,
        "degraded_allowed": r.degraded_allowed,
        "created_at": iso_or_none(r.created_at),
        "created_by": r.created_by,
        "stage_started_at": iso_or_none(r.stage_started_at),
        "audit": [
            {
                "at": iso_or_none(e.at),
                "actor": e.actor,
                "action": e.action,
                "from_state": e.from_state,
                "to_state": e.to_state,
                "stage": e.stage,
                "reason": e.reason,
                "slice": e.slice,
                "evidence": json.loads(e.evidence_json) if e.evidence_json else None,
            }
            for e in r.audit
        ],
        "counts": {
            "selected": r.counts.selected,
            "in_stage": r.counts.in_stage,
            "synced": r.counts.synced,
            "installed": r.counts.installed,
            "failed": r.counts.failed,
            "ineligible": r.counts.ineligible,
            "ineligible_reasons": dict(sorted(r.counts.ineligible_reasons.items())),
            "waiting": r.counts.waiting,
            "waiting_reasons": dict(sorted(r.counts.waiting_reasons.items())),
        },
        "guardrails": {
            "halt_rules": list(r.halt_rules),
            "min_devices": r.min_devices,
            "min_inferences": r.min_inferences,
            "slice_by": r.slice_by,
        },
        "health": _health_dict(r.health) if r.HasField("health") else None,
    }


_LLM_COUNTS = ("ttft_count", "tokens_in", "tokens_out", "cancellations")


def _cohort_dict(c: fleet_pb2.CohortFigures) -> dict:
    out = {
        name: getattr(c, name)
        for name in (
            "devices",
            "inferences",
            "errors",
            "crashes",
            "fallbacks",
            "installs",
            "install_failures",
        )
    }
    for name in ("p50_us", "p95_us", "p99_us"):
        out[name] = getattr(c, name) if c.HasField(name) else None
    out["crash_signals"] = dict(sorted(c.crash_signals.items()))
    out["devices_with"] = dict(sorted(c.devices_with.items()))
    if c.HasField("decode_tps") or c.ttft_count or c.tokens_out:
        out["llm"] = {
            "decode_tps": c.decode_tps if c.HasField("decode_tps") else None,
            "ttft_p50_ms": c.ttft_p50_ms if c.HasField("ttft_p50_ms") else None,
            "ttft_p95_ms": c.ttft_p95_ms if c.HasField("ttft_p95_ms") else None,
            **{k: getattr(c, k) for k in _LLM_COUNTS},
        }
    return out


def _slice_dict(s: fleet_pb2.SliceHealth) -> dict:
    return {
        "slice": s.slice,
        "state": s.state,
        "since": iso_or_none(s.since),
        "candidate": _cohort_dict(s.candidate),
        "baseline": _cohort_dict(s.baseline),
        "rules": [
            {
                "rule": v.rule,
                "status": v.status,
                **{
                    k: getattr(v, k) if v.HasField(k) else None
                    for k in ("value", "bound", "candidate", "baseline")
                },
                "detail": v.detail,
                "sentence": v.sentence or None,
            }
            for v in s.rules
        ],
    }


def _health_dict(h: fleet_pb2.RolloutHealth) -> dict:
    return {
        "since": iso_or_none(h.since),
        "overall": _slice_dict(h.overall),
        "slices": [_slice_dict(s) for s in h.slices],
        "outside": {"reports": h.outside_reports, "devices": h.outside_devices},
    }


def preview_dict(r: fleet_pb2.Rollout) -> dict:
    """JSON-ready form of a dry run: the rollout it would be and what it would select."""
    p = r.preview
    return {
        "dry_run": True,
        "rollout": rollout_dict(r),
        "selected": p.selected,
        "stages": [
            {"stage": i, "percent": float(pct), "devices": n}
            for i, (pct, n) in enumerate(zip(r.stages, p.devices, strict=True), start=1)
        ],
        "slices": [{"slice": s.slice, "devices": list(s.devices)} for s in p.slices],
        "more_slices": p.more_slices,
    }


def api_token_dict(t) -> dict:
    """JSON-ready form of an API token (its id and metadata; never a secret)."""
    return {
        "id": t.id,
        "name": t.name,
        "role": t.role,
        "created_at": iso_or_none(t.created_at),
        "created_by": t.created_by,
        "expires_at": iso_or_none(t.expires_at),
        "revoked_at": iso_or_none(t.revoked_at),
    }


def backends_dict(t: fleet_pb2.ClassBackends) -> dict:
    """JSON-ready form of one device class's backend table."""
    return {
        "variant": t.variant,
        "device_class": dict(sorted(t.device_class.items())),
        "recommended": t.recommended or None,
        "configs": [
            {
                "config": c.config,
                "devices": c.devices,
                "samples": c.samples,
                "inferences": c.inferences,
                **{
                    k: getattr(c, k) if c.HasField(k) else None
                    for k in ("p50_us", "p95_us", "crash_rate", "fallback_rate")
                },
                "eligible": c.eligible,
                "why": c.why or None,
                "recommended": c.config == t.recommended,
            }
            for c in t.configs
        ],
    }
