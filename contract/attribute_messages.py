"""Device attributes and times on the wire: light enough for the device agent to import."""

from __future__ import annotations

import datetime as dt

from google.protobuf.timestamp_pb2 import Timestamp

from protos import device_pb2

_STRING_KEYS = ("platform", "os_version", "app_version", "device_model", "soc", "region")


def timestamp(value: dt.datetime | None) -> Timestamp | None:
    """Return a Timestamp, or None for a missing time."""
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def attributes_dict(msg: device_pb2.DeviceAttributes) -> dict:
    """Return the raw attribute dict (validated later by `normalize_attributes`)."""
    out: dict = {k: getattr(msg, k) for k in _STRING_KEYS if getattr(msg, k)}
    if msg.ram_mb:
        out["ram_mb"] = msg.ram_mb
    # The wire cannot tell "no tags" from "tags not reported"; a device has a (maybe
    # empty) tag set, so `tags!=beta` and `tags not in (beta)` match untagged devices.
    out["tags"] = list(msg.tags)
    if msg.custom:
        out["custom"] = dict(msg.custom)
    return out


def attributes_pb(attrs: dict) -> device_pb2.DeviceAttributes:
    """Return the message for a canonical attribute dict."""
    return device_pb2.DeviceAttributes(
        **{k: attrs[k] for k in _STRING_KEYS if k in attrs},
        ram_mb=int(attrs.get("ram_mb", 0)),
        tags=list(attrs.get("tags", ())),
        custom=dict(attrs.get("custom", {})),
    )
