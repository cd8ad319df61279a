"""Typed domain errors.

Handlers raise these; the gRPC layer maps them to status codes through one table
(`control_plane.api.grpc_errors`). Messages are one line, name the problem, and never carry
secrets or plaintext.
"""

from __future__ import annotations


class SkiffError(Exception):
    """Base class of every error Skiff reports to a caller."""


class InvalidArgument(SkiffError):
    """The request itself is malformed (bad name, empty file, unknown variant...)."""


class InvalidModel(InvalidArgument):
    """The uploaded bytes are not a model MNN can load or convert."""


class TooLarge(SkiffError):
    """An upload exceeds the configured size limit."""


class Busy(SkiffError):
    """Too much of this is in progress already (uploads...); try again later."""


class NotFound(SkiffError):
    """A named model, version, variant or blob does not exist."""


class AlreadyExists(SkiffError):
    """A uniqueness constraint was violated (lost a race, duplicate name...)."""


class Unauthenticated(SkiffError):
    """Missing or wrong credentials."""


class UnknownCredential(Unauthenticated):
    """A credential nobody was given: a guess, as far as throttling is concerned.

    (An expired or used-up one is a plain Unauthenticated: its holder is no guesser.)
    """


class Unavailable(SkiffError):
    """A backing service (database, blob store, KMS) cannot be reached; retryable."""


class IntegrityError(SkiffError):
    """Stored data failed verification (digest mismatch, bad signature, bad ciphertext)."""


class PermissionDenied(SkiffError):
    """Authenticated, but not allowed to do this."""


class FailedPrecondition(SkiffError):
    """The target is not in a state that allows this (an illegal rollout transition...)."""


class OutOfRange(SkiffError):
    """A position past the end (a download offset beyond the artifact)."""
