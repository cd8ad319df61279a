"""Device profiles: what attributes simulated devices report, sampled reproducibly.

A profile is JSON in one of three shapes:

    {"devices": [{"attributes": {...}}, ...]}          explicit list; device i gets entry
                                                        i mod len
    {"mix": {"platform": {"android": 0.7, "ios": 0.3},  one distribution per key
             "ram_mb": {"4096": 0.5, "8192": 0.5},
             "tags": {"beta": 0.1},                     each tag independently
             "custom": {"carrier": {"a": 0.5, "b": 0.5}}}}
    {"classes": [{"weight": 0.6, "mix": {...}}, ...]}   a weighted choice of mixes, so
                                                        attributes can be correlated
                                                        (an iPhone never has an rk3588)

Any shape may add `"inject": [...]`: faults a slice of the fleet shows in what it reports
while it runs one version (see control_plane.sim.load). A profile of faults alone,
`{"inject": [...]}`, applies them to the default fleet (default_profile.json).

Device i's attributes depend only on the seed, i and the profile, never on how many
devices were made before it, so a run that adds devices leaves the old ones as they were.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from contract import errors
from control_plane.fleet.attributes import STANDARD_KEYS, normalize_attributes

_CHOICE_KEYS = tuple(k for k in STANDARD_KEYS if k != "tags")
_TOLERANCE = 1e-6
MAX_ENTRIES = 100_000

# (value, cumulative probability) pairs for one key.
Distribution = tuple[tuple[object, float], ...]


@dataclass(frozen=True)
class Mix:
    """Independent distributions over attribute keys."""

    choices: tuple[tuple[str, Distribution], ...]
    tags: tuple[tuple[str, float], ...]
    custom: tuple[tuple[str, Distribution], ...]

    def sample(self, rng: random.Random) -> dict:
        """Draw one device's attributes (keys in a fixed order, so draws reproduce)."""
        raw: dict = {key: _draw(dist, rng) for key, dist in self.choices}
        if self.tags:
            raw["tags"] = [tag for tag, p in self.tags if rng.random() < p]
        if self.custom:
            raw["custom"] = {key: _draw(dist, rng) for key, dist in self.custom}
        return normalize_attributes(raw)


@dataclass(frozen=True)
class Profile:
    """A validated profile: an explicit device list or weighted mixes."""

    devices: tuple[dict, ...] = ()
    classes: tuple[tuple[Mix, float], ...] = ()
    # What slices of the fleet show while they run a version (control_plane.sim.load).
    injections: tuple = ()

    def attributes(self, seed: int, index: int) -> dict:
        """Return device `index`'s attributes (canonical form) for this seed."""
        if self.devices:
            return dict(self.devices[index % len(self.devices)])
        rng = random.Random(f"skiff-sim:{seed}:{index}")
        pick = rng.random()
        for mix, cumulative in self.classes:
            if pick < cumulative:
                return mix.sample(rng)
        return self.classes[-1][0].sample(rng)


def _draw(dist: Distribution, rng: random.Random) -> object:
    pick = rng.random()
    for value, cumulative in dist:
        if pick < cumulative:
            return value
    return dist[-1][0]


def load_profile(path: Path | None = None) -> Profile:
    """Read and validate a profile file (the shipped default when `path` is None)."""
    if path is None:
        text = resources.files(__package__).joinpath("default_profile.json").read_text()
        return parse_profile(json.loads(text), source="default profile")
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read profile {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"profile {path} is not JSON: {exc}") from None
    return parse_profile(data, source=str(path))


def parse_profile(data: object, *, source: str = "profile") -> Profile:
    """Validate a parsed profile; InvalidArgument names the file and the bad entry."""
    try:
        return _parse(data)
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"{source}: {exc}") from None


def _parse(data: object) -> Profile:
    if not isinstance(data, Mapping):
        raise errors.InvalidArgument("must be a JSON object")
    shapes = [k for k in ("devices", "mix", "classes") if k in data]
    unknown = sorted(set(data) - {"devices", "mix", "classes", "description", "inject"})
    if unknown:
        raise errors.InvalidArgument(f"unknown key {', '.join(map(repr, unknown))}")
    if len(shapes) > 1:
        raise errors.InvalidArgument("has more than one of 'devices', 'mix' and 'classes'")
    if not shapes and "inject" not in data:
        raise errors.InvalidArgument("needs 'devices', 'mix', 'classes' or 'inject'")
    from control_plane.sim.load import parse_injections

    injections = parse_injections(data.get("inject", []))
    if not shapes:  # faults only: on the default fleet
        return replace(load_profile(), injections=injections)
    if "devices" in data:
        return Profile(devices=_parse_devices(data["devices"]), injections=injections)
    if "mix" in data:
        return Profile(classes=((_parse_mix(data["mix"], "mix"), 1.0),), injections=injections)
    return Profile(classes=_parse_classes(data["classes"]), injections=injections)


def _parse_devices(entries: object) -> tuple[dict, ...]:
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise errors.InvalidArgument("'devices' must be a non-empty list")
    if len(entries) > MAX_ENTRIES:
        raise errors.InvalidArgument(f"'devices' has more than {MAX_ENTRIES} entries")
    out = []
    for i, entry in enumerate(entries):
        where = f"devices[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"attributes"}:
            raise errors.InvalidArgument(f"{where} must be an object with just 'attributes'")
        out.append(_normalized(entry["attributes"], f"{where}.attributes"))
    return tuple(out)


def _parse_classes(entries: object) -> tuple[tuple[Mix, float], ...]:
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise errors.InvalidArgument("'classes' must be a non-empty list")
    mixes, weights = [], []
    for i, entry in enumerate(entries):
        where = f"classes[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"weight", "mix"}:
            raise errors.InvalidArgument(f"{where} must be an object with 'weight' and 'mix'")
        weights.append(_probability(entry["weight"], f"{where}.weight"))
        mixes.append(_parse_mix(entry["mix"], f"{where}.mix"))
    cumulative = _cumulative(weights, "classes weights")
    return tuple(zip(mixes, cumulative, strict=True))


def _parse_mix(mix: object, where: str) -> Mix:
    if not isinstance(mix, Mapping) or not mix:
        raise errors.InvalidArgument(f"{where} must be a non-empty object")
    unknown = sorted(k for k in mix if k not in (*STANDARD_KEYS, "custom"))
    if unknown:
        raise errors.InvalidArgument(f"{where}: unknown attribute key {', '.join(unknown)}")
    choices = tuple(
        (key, _distribution(mix[key], key, f"{where}.{key}")) for key in _CHOICE_KEYS if key in mix
    )
    tags = _tags(mix.get("tags", {}), f"{where}.tags")
    custom_raw = mix.get("custom", {})
    if not isinstance(custom_raw, Mapping):
        raise errors.InvalidArgument(f"{where}.custom must be an object of distributions")
    custom = tuple(
        (key, _distribution(dist, key, f"{where}.custom.{key}", custom=True))
        for key, dist in custom_raw.items()
    )
    return Mix(choices, tags, custom)


def _distribution(raw: object, key: str, where: str, *, custom: bool = False) -> Distribution:
    if not isinstance(raw, Mapping) or not raw:
        raise errors.InvalidArgument(f"{where} must be a non-empty object of value: probability")
    values, probabilities = [], []
    for value, p in raw.items():
        attrs = {"custom": {key: value}} if custom else {key: value}
        normalized = _normalized(attrs, f"{where} value {value!r}")
        values.append(normalized["custom"][key] if custom else normalized[key])
        probabilities.append(_probability(p, f"{where}[{value!r}]"))
    return tuple(zip(values, _cumulative(probabilities, where), strict=True))


def _tags(raw: object, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(raw, Mapping):
        raise errors.InvalidArgument(f"{where} must be an object of tag: probability")
    _normalized({"tags": list(raw)}, where)
    return tuple((tag, _probability(p, f"{where}[{tag!r}]")) for tag, p in raw.items())


def _probability(value: object, where: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 <= value <= 1:
        raise errors.InvalidArgument(f"{where} must be a probability from 0 to 1, got {value!r}")
    return float(value)


def _cumulative(probabilities: list[float], where: str) -> list[float]:
    total = math.fsum(probabilities)
    if abs(total - 1) > _TOLERANCE:
        raise errors.InvalidArgument(f"{where}: probabilities sum to {total:g}, not 1")
    out, running = [], 0.0
    for p in probabilities:
        running += p
        out.append(running)
    return out


def _normalized(attrs: object, where: str) -> dict:
    try:
        return normalize_attributes(attrs)  # type: ignore[arg-type]
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"{where}: {exc}") from None
