"""One error family for preload. The server maps each class to a gRPC status code in one place
(`STATUS_CODES`) and the client maps the code back, so a caller catches the same class on both
sides of the socket."""

import grpc


class PreloadError(Exception):
    """Base class: the message names the problem and what to do about it."""


class CheckpointError(PreloadError):
    """The checkpoint on disk is missing, malformed or contradicts its config."""


class PlanError(PreloadError):
    """The requested layout (TP size, dtype, scheme, component) cannot be built from this model."""


class NotFoundError(PreloadError):
    """No such model, version or lease."""


class StaleError(PreloadError):
    """What the daemon holds does not match what the caller expects (cache key mismatch)."""


class LeasedError(PreloadError):
    """The model is leased by live processes; eviction needs --force."""


class BudgetError(PreloadError):
    """A load does not fit the model's byte budget, even after retention freed what it may."""


class LoadingError(PreloadError):
    """What the caller wants is still loading; retry shortly."""


class AccessDeniedError(PreloadError):
    """The caller is not allowed to talk to this daemon."""


class DaemonUnavailableError(PreloadError):
    """No daemon answers on the socket."""


class InvalidRequestError(PreloadError):
    """A request that is malformed or out of bounds."""


STATUS_CODES: dict[type[PreloadError], grpc.StatusCode] = {
    CheckpointError: grpc.StatusCode.INVALID_ARGUMENT,
    PlanError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    StaleError: grpc.StatusCode.FAILED_PRECONDITION,
    LeasedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BudgetError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    LoadingError: grpc.StatusCode.UNAVAILABLE,
    AccessDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    DaemonUnavailableError: grpc.StatusCode.UNAVAILABLE,
}

# The error class travels in the status details' prefix so that two classes sharing a code
# (CheckpointError and PlanError) come back as themselves.
_BY_NAME = {cls.__name__: cls for cls in STATUS_CODES}


# gRPC sends status details percent-encoded in trailing metadata and drops (with the error class)
# what is over 8 KiB encoded: up to 3 bytes per UTF-8 byte, so 2 KiB of UTF-8 always fits.
MAX_DETAILS_BYTES = 2 << 10


def to_status(error: PreloadError) -> tuple[grpc.StatusCode, str]:
    """The status code and details of an error: one line (request strings echoed in a message may
    hold line breaks or control characters: they are escaped), cut to what gRPC always delivers."""
    code = STATUS_CODES.get(type(error), grpc.StatusCode.INTERNAL)
    details = "".join(c if c.isprintable() else repr(c)[1:-1] for c in f"{type(error).__name__}: {error}")
    raw = details.encode()
    if len(raw) > MAX_DETAILS_BYTES:
        details = raw[:MAX_DETAILS_BYTES - 12].decode(errors="ignore") + " ... (cut)"
    return code, details


def from_rpc_error(error: grpc.RpcError) -> PreloadError:
    """The PreloadError that a failed RPC stands for."""
    code, details = error.code(), error.details() or ""
    name, sep, message = details.partition(": ")
    if sep and name in _BY_NAME:
        return _BY_NAME[name](message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return DaemonUnavailableError(f"daemon unavailable ({details}); start it with `preload daemon` or `preload serve`")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return AccessDeniedError(details)
    return PreloadError(f"{code.name}: {details}")
