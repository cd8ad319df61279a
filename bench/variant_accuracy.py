"""How each derived variant of the real third-party models compares with fp32, at push.

Pushes PP-OCRv4 (detector, recogniser, classifier) and Silero VAD to a real control plane
with fp16, int8 and int4 variants and realistic golden inputs (`--golden`: a synthetic
page for the OCR models, a voiced tone for Silero), `--allow-degraded` so every variant is
kept, and prints the registry's figures (worst over outputs: cosine similarity with fp32,
relative L2 error, degraded or not) and how long each push took. Not a speed benchmark:
it records the accuracy a publisher gets, which the registry gates on. The last line is
one JSON object.

    python bench/variant_accuracy.py
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from control_plane.demo.third_party_models import THIRD_PARTY_MODELS  # noqa: E402
from runtime.npz import write_npz  # noqa: E402
from tests.control_plane.helpers import start_control_plane  # noqa: E402

VARIANTS = ("fp16", "int8", "int4")


def main() -> None:
    """Push every model, print a row per model, then the JSON line."""
    work = Path(tempfile.mkdtemp(prefix="skiff-variants-"))
    plane = start_control_plane(work / "home")
    results = {}
    try:
        with plane.client() as client:
            for model in THIRD_PARTY_MODELS:
                golden = work / f"{model.name}.npz"
                golden.write_bytes(write_npz(model.golden_inputs()))
                start = time.perf_counter()
                version = client.push(
                    model.path,
                    name=model.name,
                    golden=golden,
                    variants=VARIANTS,
                    allow_degraded=True,
                )
                took = time.perf_counter() - start
                results[model.name] = {"push_s": round(took, 2)} | {
                    v.name: {
                        "cosine": round(v.accuracy.cosine, 4),
                        "relative_error": round(v.accuracy.relative_error, 4),
                        "degraded": v.degraded,
                    }
                    for v in version.variants[1:]
                }
                print(_row(model.name, results[model.name]), flush=True)
    finally:
        plane.stop()
    print("reproduce:", shlex.join([sys.executable, *sys.argv]))
    print(json.dumps({"variant_accuracy": results}))


def _row(name: str, figures: dict) -> str:
    cells = [f"{name:<16} push {figures['push_s']:5.1f} s"]
    for variant in VARIANTS:
        f = figures[variant]
        flag = " DEGRADED" if f["degraded"] else ""
        cells.append(f"{variant} cos {f['cosine']:.4f} rel {f['relative_error']:.3g}{flag}")
    return " | ".join(cells)


if __name__ == "__main__":
    main()
