"""A simulated fleet: real gRPC clients of a real control plane (`skiff sim`, benchmarks).

`FleetSimulator` is the API: enroll devices (attributes from a `Profile`), Sync them,
hold their Watch streams, and wait until the devices a change affects have synced it.
"""

from control_plane.sim.fleet import FleetSimulator, SimOptions
from control_plane.sim.profile import Profile, load_profile, parse_profile
from control_plane.sim.state import Identity, load_state, save_state
from control_plane.sim.stats import FleetStats, TargetCount

__all__ = [
    "FleetSimulator",
    "FleetStats",
    "Identity",
    "Profile",
    "SimOptions",
    "TargetCount",
    "load_profile",
    "load_state",
    "parse_profile",
    "save_state",
]
