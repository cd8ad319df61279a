"""Device telemetry: validate and store what agents report; summarise it per device."""

from control_plane.telemetry.reports import DeviceLatency, Telemetry

__all__ = ["DeviceLatency", "Telemetry"]
