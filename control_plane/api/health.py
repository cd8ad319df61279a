"""What the gRPC health service reports: SERVING only while the database and blob store work.

A load balancer or Kubernetes probe asks `grpc.health.v1.Health/Check`; a replica whose
database or blob store is unreachable should leave rotation rather than fail every call.
The monitor probes both on a timer and reports each transition once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from contract import errors

log = logging.getLogger(__name__)


class HealthMonitor:
    """Probes named dependencies and publishes SERVING (True) or NOT_SERVING (False)."""

    def __init__(
        self, probes: Mapping[str, Callable[[], None]], publish: Callable[[bool], None]
    ) -> None:
        self._probes, self._publish = dict(probes), publish
        self._serving = True  # what the server starts out reporting

    @property
    def serving(self) -> bool:
        """Return what was last published."""
        return self._serving

    def check(self) -> bool:
        """Probe every dependency once; publish and log only when the answer changes."""
        failures = []
        for name, probe in self._probes.items():
            try:
                probe()
            except errors.SkiffError as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                failures.append(f"{name}: {reason}")
            except Exception as exc:  # noqa: BLE001 - any failed probe means not serving
                failures.append(f"{name}: {type(exc).__name__}")
        serving = not failures
        if serving != self._serving:
            self._publish(serving)
            self._serving = serving
            if serving:
                log.info("health: SERVING again (database and blob store reachable)")
            else:
                log.warning("health: NOT_SERVING (%s)", "; ".join(failures))
        return serving
