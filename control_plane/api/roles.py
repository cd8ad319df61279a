"""Who may call what: the one table of every RPC and the credential it needs.

Operators' API tokens carry one role. Viewer reads; publisher pushes models; operator
drives devices and rollouts; admin does everything (keys, tokens, enrollment tokens,
plaintext pulls).
Publisher and operator include viewer. Device calls need a device credential, Enroll an
enrollment token, and health and reflection nothing. An RPC missing from the table is
refused (the server checks the table covers every method it serves at start).
"""

from __future__ import annotations

VIEWER = "viewer"
PUBLISHER = "publisher"
OPERATOR = "operator"
ADMIN = "admin"
ROLES = (ADMIN, OPERATOR, PUBLISHER, VIEWER)

# Not roles: the other kinds of credential an RPC can need.
DEVICE = "device"  # `authorization: Bearer skd_...` from Enroll
ENROLLMENT = "enrollment"  # the enrollment token inside EnrollRequest
PUBLIC = "public"  # no credential

RPC_ROLES: dict[str, str] = {
    # Models and keys.
    "/skiff.v1.AdminService/PushModel": PUBLISHER,
    "/skiff.v1.AdminService/ListModels": VIEWER,
    "/skiff.v1.AdminService/GetModel": VIEWER,
    "/skiff.v1.AdminService/PullModel": ADMIN,  # the decrypted model
    "/skiff.v1.AdminService/RotateKek": ADMIN,
    "/skiff.v1.AdminService/GetSigningKeys": VIEWER,
    "/skiff.v1.AdminService/RotateSigningKey": ADMIN,
    "/skiff.v1.AdminService/CreateApiToken": ADMIN,
    "/skiff.v1.AdminService/ListApiTokens": ADMIN,
    "/skiff.v1.AdminService/RevokeApiToken": ADMIN,
    "/skiff.v1.AdminService/CollectGarbage": ADMIN,
    # Devices.
    # Admin, not operator: an operator who could also enroll a device of its own could
    # target it with a rollout and so receive any model's data key (plaintext by another
    # road than PullModel).
    "/skiff.v1.FleetService/CreateEnrollmentToken": ADMIN,
    "/skiff.v1.FleetService/ListDevices": VIEWER,
    "/skiff.v1.FleetService/GetDevice": VIEWER,
    "/skiff.v1.FleetService/RevokeDevice": OPERATOR,
    "/skiff.v1.FleetService/GetBackends": VIEWER,
    # Rollouts.
    "/skiff.v1.RolloutService/CreateRollout": OPERATOR,
    "/skiff.v1.RolloutService/ListRollouts": VIEWER,
    "/skiff.v1.RolloutService/GetRollout": VIEWER,
    "/skiff.v1.RolloutService/TransitionRollout": OPERATOR,
    # The device API.
    "/skiff.v1.DeviceService/Enroll": ENROLLMENT,
    "/skiff.v1.DeviceService/Sync": DEVICE,
    "/skiff.v1.DeviceService/Ack": DEVICE,
    "/skiff.v1.DeviceService/Watch": DEVICE,
    "/skiff.v1.DeviceService/Download": DEVICE,
    "/skiff.v1.DeviceService/DownloadChunks": DEVICE,
    "/skiff.v1.DeviceService/Report": DEVICE,
    # Infrastructure.
    "/grpc.health.v1.Health/Check": PUBLIC,
    "/grpc.health.v1.Health/Watch": PUBLIC,
    "/grpc.health.v1.Health/List": PUBLIC,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": PUBLIC,
}


def grants(role: str, needed: str) -> bool:
    """Return whether a token of `role` may make a call that needs `needed`."""
    if needed not in ROLES:
        return False  # device, enrollment and public calls do not take API tokens
    return role == ADMIN or role == needed or needed == VIEWER and role in ROLES
