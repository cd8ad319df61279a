"""Tables and text for people about models and versions.

What the CLI prints without `--json`, and the demo's story, over the same messages as
control_plane.views.registry's JSON documents.
"""

from __future__ import annotations

from control_plane.registry import accuracy_bars
from control_plane.views.registry import iso, pipeline
from protos import common_pb2


def _dims(shape) -> str:
    return "x".join("?" if d < 0 else str(d) for d in shape) or "scalar"


def _tensors(specs) -> str:
    return ", ".join(f"{t.name}[{_dims(t.shape)}] {t.dtype}" for t in specs)


def models_table(models: list[common_pb2.Model]) -> str:
    """Render models as a plain table."""
    if not models:
        return "no models yet: push one with `skiff model push FILE --name NAME`"
    rows = [("NAME", "LATEST", "VERSIONS", "CREATED")]
    rows += [
        (m.name, str(m.latest_version), str(m.version_count), iso(m.created_at)) for m in models
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def version_text(v: common_pb2.ModelVersion, *, signed_by: str = "", unverified: str = "") -> str:
    """Describe one version for people; "signed by" only for a signature checked by the CLI."""
    signature = f"signed by {signed_by}" if signed_by else f"signature NOT verified: {unverified}"
    lines = [
        f"{v.model}:{v.version}",
        f"  created   {iso(v.created_at)} by {v.created_by}",
        f"  source    {v.source_format}, MNN {v.signature.mnn_version}",
        f"  inputs    {_tensors(v.signature.inputs)}",
        f"  outputs   {_tensors(v.signature.outputs)}",
        f"  manifest  {signature}",
    ]
    if v.signature.HasField("llm"):
        llm = v.signature.llm
        template = "a chat template" if llm.chat_template else "no chat template (completion)"
        lines[4:6] = [
            f"  llm       {llm.architecture}, {llm.layers} layers, hidden {llm.hidden_size}, "
            f"vocab {llm.vocab_size:,}, context {llm.context_length:,} tokens, {template}"
        ]
    if v.notes:
        lines.insert(2, f"  notes     {v.notes}")
    if v.HasField("golden"):
        source = "the publisher's inputs" if v.golden.source == "publisher" else "seeded inputs"
        lines.append(f"  golden    {source}, {v.golden.plaintext_size:,} B (encrypted)")
    events_pipeline = pipeline(v)
    if events_pipeline:
        triggers = ", ".join(f"{t['name']} ({t['pattern']})" for t in events_pipeline["triggers"])
        events = ", ".join(events_pipeline["event_types"])
        lines.append(f"  pipeline  events {events}; triggers {triggers}")
    lines.append("  variants")
    for var in v.variants:
        lines.append(
            f"    {var.name:<5} {var.plaintext_size:>12,} B  sha256 {var.plaintext_sha256[:16]}…"
            f"  encrypted {var.ciphertext_size:,} B{_accuracy(var)}"
        )
        if var.signature.HasField("llm"):
            needs = var.signature.llm
            lines.append(
                f"          fits a device with {needs.memory_mb:,} MB of memory and "
                f"{needs.disk_mb:,} MB of disk (MNN {var.signature.mnn_version})"
            )
        if var.HasField("accuracy") and len(var.accuracy.outputs) > 1:
            for out in var.accuracy.outputs:
                lines.append(
                    f"          {out.name}: cosine {out.cosine:.4f}, relative error "
                    f"{out.relative_error:.3g}, max abs error {out.max_abs_error:.3g}"
                )
    return "\n".join(lines)


def _accuracy(var: common_pb2.Variant) -> str:
    """Say how a derived variant compares with fp32 (nothing for fp32 itself)."""
    if not var.HasField("accuracy"):
        return ""
    a = var.accuracy
    verdict = f"  {accuracy_bars.degraded_label(a)}" if var.degraded else ""
    if a.min_top1:
        return (
            f"  vs reference: top-1 agreement {a.top1_agreement:.3f} (bar {a.min_top1:.2f}), "
            f"mean KL {a.mean_kl:.3g} over {a.positions} positions{verdict}"
        )
    return (
        f"  vs fp32: cosine {a.cosine:.4f}, relative error {a.relative_error:.3g}, "
        f"max abs error {a.max_abs_error:.3g}{verdict}"
    )
