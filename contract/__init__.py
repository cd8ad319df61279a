"""What a device and the control plane must agree on, imported by both and importing neither.

Skiff has two sides that ship apart: the device side (`device_agent`, `runtime`), which
`pip install skiff` puts on phones and IoT boxes, and the cloud side (`control_plane`,
`dashboards`), which `skiff[server]` adds. Whatever both must read and write the same way
lives here, once, so that neither side imports the other (as Flower keeps `flwr.common`
between its client and server, and hawkBit its device API in a module of its own):

- `errors`: the error types both raise and map to gRPC status codes;
- `limits`: names, lengths and text rules every message is checked against;
- `attribute_messages`: device attributes <-> their protobuf message; `attribute_rules`:
  the canonical shape of device attributes and its checks (and the `--attr` flag);
- `envelope`, `segments`: the streaming AEAD envelope of an artifact and the digests of
  its segments (a device verifies what the control plane encrypted);
- `assignment`, `pinned_keys`: canonical JSON, signatures, signed Sync answers and the
  signing keys a device pins;
- `key_wrap`: the HPKE context that wraps a version's data key to one device;
- `server_clock`: the control plane's time as a device measures it from signed answers;
- `report_batches`: report batch ids, timestamps, histograms and the outbox bounds;
- `transport`, `key_files`: TLS and loopback rules, what a failed connection means, and
  key and certificate files read the same careful way on both sides;
- `device_client`: the device API's client (the agent's, and the fleet simulator's);
- `local_api`: where an agent's local socket is and how tensors travel on it;
- `command_line`, `extras`: the exit codes, one-line errors and help both `skiff` command
  lines share, and which of skiff's parts this install holds (its own entry points only).

The latency histogram's layout is the runtime's (`runtime.histogram`): the runtime
records it and may import nothing of Skiff, so both sides read it from there. The wire
messages themselves are `protos`.
"""
