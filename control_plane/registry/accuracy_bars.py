"""The accuracy bars a derived variant is held to: judged and worded here, once.

A derived variant (fp16, int8, int4) is held to two bars against fp32, on every output:
cosine similarity at least `min_cosine`, and a relative L2 error at most what that cosine
allows at the right scale, sqrt(2 * (1 - min_cosine)) (cosine alone passes an output 15
times too small). A variant that misses either is degraded. Saying "below 0.99" for one
whose cosine is 0.9996 hides that it was the relative error that failed, so every surface
(the push's summary and refusal, `model show`, its `--json`, rollouts, the dashboard)
says which bar failed through this module.

Figures arrive as the registry stores them (None for an output that was missing or not
finite), as protobuf messages (inf) or as protobuf's JSON ("Infinity"); all are read
alike. Nothing heavy is imported: the CLI uses it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COSINE",
    "RELATIVE_ERROR",
    "TOP1",
    "Bar",
    "bars",
    "degraded_label",
    "failed_bars",
    "max_relative_error",
    "reason",
    "variant_status",
]

COSINE, RELATIVE_ERROR = "cosine", "relative_error"
# A language model variant's one bar: teacher-forced top-1 agreement with the reference.
TOP1 = "top1_agreement"


def max_relative_error(min_cosine: float) -> float:
    """Return the relative error a cosine bar allows: sqrt(2 * (1 - min_cosine))."""
    return math.sqrt(max(0.0, 2.0 * (1.0 - min_cosine)))


@dataclass(frozen=True)
class Bar:
    """One bar as a variant met it or missed it: the worst output's figure and the limit."""

    name: str  # COSINE (at least `limit`) or RELATIVE_ERROR (at most `limit`)
    value: float  # inf (relative error) or 0.0 (cosine) when an output was not finite
    limit: float
    passed: bool
    output: str = ""  # the worst output, named when the bar failed

    def text(self) -> str:
        """Say it in a few words: "relative error 0.312 above 0.141 on output 'y'"."""
        if self.name == TOP1:
            verdict = ">=" if self.passed else "below"
            value, limit = _pair(self.value, self.limit, self.passed, "f", 3)
            return f"top-1 agreement {value} {verdict} {limit}"
        if self.name == COSINE:
            verdict = ">=" if self.passed else "below"
            value, limit = _pair(self.value, self.limit, self.passed, "f", 4)
            figure = f"cosine {value}"
        else:
            verdict = "<=" if self.passed else "above"
            value, limit = _pair(self.value, self.limit, self.passed, "g", 3)
            figure = f"relative error {value if math.isfinite(self.value) else 'infinite'}"
        where = f" on output {self.output!r:.64}" if self.output and not self.passed else ""
        return f"{figure} {verdict} {limit}{where}"

    def to_json(self) -> dict[str, Any]:
        """Return the JSON form (`value` None when not finite: JSON has no infinity)."""
        return {
            "bar": self.name,
            "output": self.output,
            "value": self.value if math.isfinite(self.value) else None,
            "limit": self.limit,
            "passed": self.passed,
        }


def bars(figures: Any) -> tuple[Bar, ...]:
    """Return both bars as a variant's figures meet them (none: no accuracy recorded).

    `figures` is a mapping or a message with `cosine`, `relative_error`, `min_cosine` and
    `outputs` (each with `name`, `cosine`, `relative_error`).
    """
    min_top1 = _number(_get(figures, "min_top1"), 0.0)
    if min_top1:  # a language model variant
        agreement = _number(_get(figures, TOP1), 0.0)
        return (Bar(TOP1, agreement, min_top1, agreement >= min_top1),)
    min_cosine = _number(_get(figures, "min_cosine"), 0.0)
    if not min_cosine:  # fp32 itself, or a version from before the bars
        return ()
    outputs = [
        (
            str(_get(o, "name") or ""),
            _number(_get(o, COSINE), 0.0),
            _number(_get(o, RELATIVE_ERROR), math.inf),
        )
        for o in _get(figures, "outputs") or ()
    ]
    cosine = _number(_get(figures, COSINE), 0.0)
    relative = _number(_get(figures, RELATIVE_ERROR), math.inf)
    allowed = max_relative_error(min_cosine)
    # The worst output is worth naming only where there are several.
    lowest = min(outputs, key=lambda o: o[1])[0] if len(outputs) > 1 else ""
    highest = max(outputs, key=lambda o: o[2])[0] if len(outputs) > 1 else ""
    return (
        Bar(COSINE, cosine, min_cosine, cosine >= min_cosine, lowest),
        Bar(RELATIVE_ERROR, relative, allowed, relative <= allowed, highest),
    )


def failed_bars(figures: Any) -> tuple[Bar, ...]:
    """Return the bars a variant's figures miss (none: it passed, or it has no figures)."""
    return tuple(bar for bar in bars(figures) if not bar.passed)


def reason(figures: Any) -> str:
    """Say how a variant fares: the failed bars first, the passed ones after.

    "relative error 0.312 above 0.141 on output 'y' (cosine 0.9996 >= 0.99)" for a
    variant that failed only the relative error; "cosine 1.0000 >= 0.99, relative error
    0.0004 <= 0.141" for one that passed both; "" without figures.
    """
    checked = bars(figures)
    failed = [bar.text() for bar in checked if not bar.passed]
    passed = ", ".join(bar.text() for bar in checked if bar.passed)
    if not failed:
        return passed
    return " and ".join(failed) + (f" ({passed})" if passed else "")


def degraded_label(figures: Any) -> str:
    """Return "DEGRADED: <each bar that failed>", for a line that shows the figures."""
    failed = failed_bars(figures)
    if not failed:  # marked degraded, yet the figures do not say why
        return "DEGRADED (below the accuracy bars)"
    return "DEGRADED: " + " and ".join(bar.text() for bar in failed)


def variant_status(degraded: bool, figures: Any) -> dict[str, Any]:
    """Return a variant's `status` ("kept" or "degraded") and `failed_bars`, for JSON."""
    failed = failed_bars(figures) if degraded else ()
    return {
        "status": "degraded" if degraded else "kept",
        "failed_bars": [bar.to_json() for bar in failed],
    }


def _pair(value: float, limit: float, passed: bool, kind: str, digits: int) -> tuple[str, str]:
    """Format a figure and its limit with digits enough to show which side it is on.

    A cosine of 0.99996 against a 0.99999 bar reads "1.0000 below 0.99999" at four
    decimals; it takes five to be true.
    """
    for extra in range(6):
        text = f"{value:.{digits + extra}{kind}}"
        if (float(text) >= limit if kind == "f" else float(text) <= limit) == passed:
            break
    return text, f"{limit:g}" if kind == "f" else f"{limit:.3g}"


def _get(source: Any, key: str) -> Any:
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source.get(key)
    return getattr(source, key, None)


def _number(value: Any, missing: float) -> float:
    """Read a figure: None (stored), "Infinity"/"NaN" (protobuf JSON) or a number."""
    if value is None:
        return missing
    try:
        number = float(value)
    except (TypeError, ValueError):
        return missing
    return missing if math.isnan(number) else number
