"""What happened to a model while it ran: fallbacks and worker crashes, as telemetry data.

Both are frozen values with `to_dict()`; the device agent buffers and reports them as
they are. Times are wall-clock Unix seconds (they are compared across devices).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.backends import BackendConfig

__all__ = ["CrashEvent", "FallbackEvent"]


@dataclass(frozen=True)
class FallbackEvent:
    """A config was marked bad; the model moved to `to_config` (None: none left).

    `reason` is one line: "load failed: ...", "inference error: ...", "non-finite
    outputs: y", "crashed 3 times, last: SIGSEGV", "rejected by probe: cosine 0.91".
    """

    from_config: BackendConfig
    to_config: BackendConfig | None
    reason: str
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict for telemetry."""
        return {
            "from_config": self.from_config.key,
            "to_config": self.to_config.key if self.to_config else None,
            "reason": self.reason,
            "time": self.time,
        }


@dataclass(frozen=True)
class CrashEvent:
    """The worker process running `config` died or hung and was killed.

    `reason` is "signal" (killed by `signal`, e.g. SIGSEGV, SIGABRT, SIGKILL from the OOM
    killer), "exit" (exited on its own with `exit_code`), "deadline" (no answer within
    the deadline) or "protocol" (sent a malformed reply); for the last two the runtime
    killed it with SIGKILL. `count` is how many times in a row this config has crashed
    in this model (a request it serves resets it); `detail` is the worker's last log
    line, if any. `idle` marks a worker found dead between requests (the OOM killer's
    favourite moment): no request was lost, it is restarted and never counted (`count`
    0), but it is reported.
    """

    config: BackendConfig
    reason: str
    signal: str | None = None
    exit_code: int | None = None
    detail: str = ""
    count: int = 1
    time: float = field(default_factory=time.time)
    idle: bool = False

    def describe(self) -> str:
        """Return a one-line human summary, used as the exception message."""
        if self.reason == "deadline":
            what = f"missed its deadline and was killed ({self.signal})"
        elif self.reason == "protocol":
            what = f"broke the protocol and was killed ({self.signal})"
        elif self.reason == "signal":
            what = f"was killed by {self.signal}"
        else:
            what = f"exited with status {self.exit_code}"
        tail = f"; last output: {self.detail}" if self.detail else ""
        when = "while idle" if self.idle else f"(crash {self.count})"
        return f"worker running {self.config.key} {what} {when}{tail}"

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict for telemetry."""
        return {
            "config": self.config.key,
            "reason": self.reason,
            "signal": self.signal,
            "exit_code": self.exit_code,
            "detail": self.detail,
            "count": self.count,
            "time": self.time,
            "idle": self.idle,
        }
