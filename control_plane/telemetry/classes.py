"""Device classes: the attributes telemetry is grouped by, and guardrail slices cut by.

A device class is a few attributes of a device, by default `soc`, `device_model` and the
major part of `os_version` (setting `device_class`, text like
`soc,device_model,os_version:major`). Rollups keep one group per class, so fleet figures
can be read per class and a rollout can be sliced by one class attribute (`--slice-by soc`).

A class is stored as canonical JSON text (sorted keys, every dimension present, "" for
an attribute the device does not report), so equal classes are equal strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from contract import errors

DEFAULT_DEVICE_CLASS = "soc,device_model,os_version:major"
# Attributes a class may use; `custom.NAME` names a custom attribute.
CLASS_ATTRIBUTES = ("platform", "os_version", "app_version", "device_model", "soc", "region")
_VERSIONED = ("os_version", "app_version")
_CUSTOM = re.compile(r"custom\.([A-Za-z_][A-Za-z0-9_.-]{0,63})")
MAX_DIMENSIONS = 6


@dataclass(frozen=True)
class Dimension:
    """One attribute of a device class; `major` keeps a version's first number only."""

    name: str
    major: bool = False

    def value(self, attrs: Mapping) -> str:
        """Return this attribute of a device ("" when it does not report it)."""
        if self.name.startswith("custom."):
            raw = (attrs.get("custom") or {}).get(self.name[7:], "")
        else:
            raw = attrs.get(self.name, "")
        return self.normalize(str(raw))

    def normalize(self, value: str) -> str:
        """Return a value as this dimension stores it (a version's major part for :major)."""
        return re.split(r"[.\-_ ]", value, maxsplit=1)[0] if self.major else value

    def __str__(self) -> str:
        return f"{self.name}:major" if self.major else self.name


@dataclass(frozen=True)
class DeviceClass:
    """The dimensions devices are grouped by."""

    dimensions: tuple[Dimension, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Return the attribute names, in order."""
        return tuple(d.name for d in self.dimensions)

    def of(self, attrs: Mapping) -> str:
        """Return the class of a device with these attributes, as canonical JSON."""
        return json.dumps(
            {d.name: d.value(attrs) for d in self.dimensions}, sort_keys=True, ensure_ascii=False
        )

    def dimension(self, name: str) -> Dimension:
        """Return the dimension called `name`; InvalidArgument names the known ones."""
        for d in self.dimensions:
            if d.name == name:
                return d
        raise errors.InvalidArgument(
            f"unknown slice attribute {name!r:.70}: slices are cut by a device-class "
            f"attribute ({', '.join(self.names)})"
        )

    def __str__(self) -> str:
        return ",".join(str(d) for d in self.dimensions)


def parse_dimension(part: str) -> Dimension:
    """Parse one dimension (`soc`, `os_version:major`, `custom.carrier`)."""
    name, _, modifier = part.strip().partition(":")
    if name not in CLASS_ATTRIBUTES and not _CUSTOM.fullmatch(name):
        raise errors.InvalidArgument(
            f"device_class: unknown attribute {name!r:.70} "
            f"(use {', '.join(CLASS_ATTRIBUTES)} or custom.NAME)"
        )
    if modifier not in ("", "major") or (modifier and name not in _VERSIONED):
        raise errors.InvalidArgument(
            f"device_class: {part!r:.70}: only os_version and app_version take ':major'"
        )
    return Dimension(name, modifier == "major")


def parse_device_class(text: str) -> DeviceClass:
    """Parse `soc,device_model,os_version:major`; InvalidArgument names the bad part."""
    dims: list[Dimension] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        dim = parse_dimension(part)
        name = dim.name
        if any(d.name == name for d in dims):
            raise errors.InvalidArgument(f"device_class: {name!r} is listed twice")
        dims.append(dim)
    if not dims or len(dims) > MAX_DIMENSIONS:
        raise errors.InvalidArgument(f"device_class needs 1 to {MAX_DIMENSIONS} attributes")
    return DeviceClass(tuple(dims))


def class_values(device_class: str) -> dict[str, str]:
    """Return a stored class's attributes (the inverse of `DeviceClass.of`)."""
    return json.loads(device_class)
