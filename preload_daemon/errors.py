"""One error family for preload. The server maps each class to a gRPC status code in one place
(`STATUS_CODES`) and the client maps the code back, so a caller catches the same class on both
sides of the socket. Codes are held by name: importing the errors does not import grpc (an engine
that loads cold never needs it)."""


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


class VersionTakenError(InvalidRequestError):
    """The version number asked for is another version's, or was used before: another publish of
    the model took it first. Publishing again takes the next one."""


class DeviceError(PreloadError):
    """The device cannot do what was asked: no driver or GPU, a device that does not exist, CUDA
    out of memory, a slab on another GPU than the one named."""


STATUS_CODES: dict[type[PreloadError], str] = {  # grpc.StatusCode names
    CheckpointError: "INVALID_ARGUMENT",
    PlanError: "INVALID_ARGUMENT",
    InvalidRequestError: "INVALID_ARGUMENT",
    VersionTakenError: "ALREADY_EXISTS",
    NotFoundError: "NOT_FOUND",
    StaleError: "FAILED_PRECONDITION",
    LeasedError: "RESOURCE_EXHAUSTED",
    BudgetError: "RESOURCE_EXHAUSTED",
    LoadingError: "UNAVAILABLE",
    AccessDeniedError: "PERMISSION_DENIED",
    DaemonUnavailableError: "UNAVAILABLE",
    DeviceError: "FAILED_PRECONDITION",
}

# The error class travels in the status details' prefix so that two classes sharing a code
# (CheckpointError and PlanError) come back as themselves.
_BY_NAME = {cls.__name__: cls for cls in STATUS_CODES}


# gRPC sends status details percent-encoded in trailing metadata and drops (with the error class)
# what is over 8 KiB encoded: up to 3 bytes per UTF-8 byte, so 2 KiB of UTF-8 always fits.
MAX_DETAILS_BYTES = 2 << 10


def details(error: PreloadError) -> str:
    """An error as it travels ("ErrorClass: message"): one line (request strings echoed in a message
    may hold line breaks or control characters: they are escaped), cut to what gRPC always delivers."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in f"{type(error).__name__}: {error}")
    raw = text.encode()
    if len(raw) > MAX_DETAILS_BYTES:
        text = raw[:MAX_DETAILS_BYTES - 12].decode(errors="ignore") + " ... (cut)"
    return text


def to_status(error: PreloadError):
    """The grpc.StatusCode and details of an error."""
    import grpc
    return grpc.StatusCode[STATUS_CODES.get(type(error), "INTERNAL")], details(error)


def from_details(text: str) -> PreloadError | None:
    """The error that `details` made, as its own class; None if `text` names no PreloadError class."""
    name, sep, message = text.partition(": ")
    return _BY_NAME[name](message) if sep and name in _BY_NAME else None


def from_rpc_error(error) -> PreloadError:
    """The PreloadError that a failed RPC (a grpc.RpcError) stands for."""
    code, text = error.code().name, error.details() or ""
    known = from_details(text)
    if known is not None:
        return known
    if code == "UNAVAILABLE":
        return DaemonUnavailableError(f"daemon unavailable ({text}); start it with `preload daemon` or `preload serve`")
    if code == "PERMISSION_DENIED":
        return AccessDeniedError(text)
    return PreloadError(f"{code}: {text}")
