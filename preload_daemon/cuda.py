"""The `cuda` slab backend: one cudaMalloc'd allocation per slab on the daemon's GPU, exported to
workers as a CUDA IPC handle (cudaIpcGetMemHandle) through cuda-python's runtime bindings. A worker
opens each handle once (cudaIpcOpenMemHandle) on the GPU whose UUID the manifest names, and its
tensors are views of that memory; the handle is closed once the attachment and the last view of it
are gone (closing it under a live view would make that view's next read an illegal address).

Filling: the load plan writes into a pinned host staging buffer of the slab's size (the same
executor as the host backend and the cold path, so the bytes are the same), which `seal` copies to
the device in chunks and frees (pinned host memory of a slab's size is held while it fills: a
streamed publish of several variants holds one per variant); the digest is the staging bytes'
(what `verify` re-hashes by copying the device memory back in chunks). Device memory dies with
the daemon: a restarted daemon cannot adopt CUDA slabs, so they have no record on disk, and an
engine whose daemon died stops reporting ready (its lease keeper notices) rather than touching
memory that may be freed.

Nothing here imports cuda-python at module import: only a `cuda:N` daemon or a worker attaching
to one does (`runtime()`), and a missing package, driver or GPU becomes a DeviceError that says
which and what to do. The pure parts (handle and UUID encoding, device lookup by UUID, error
mapping) are plain functions, tested without a GPU."""

import ctypes
import logging
import re
import secrets
import threading

import torch

from preload_daemon.errors import DeviceError, InvalidRequestError

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
COPY_CHUNK = 64 << 20  # host <-> device copies and digests go in pieces this size
_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HINTS = {  # cudaError_t names -> what to do
    "cudaErrorInsufficientDriver": "this host has no NVIDIA driver, or one older than cuda-python's runtime; use "
                                   "cpu:N devices here, or update the driver",
    "cudaErrorNoDevice": "no GPU is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi); use cpu:N devices here",
    "cudaErrorInvalidDevice": "no such GPU in this process's view (CUDA_VISIBLE_DEVICES renumbers them)",
    "cudaErrorMemoryAllocation": "out of device memory: evict a model (`preload evict`) or use a smaller variant",
    "cudaErrorInvalidResourceHandle": "the slab's IPC handle is not valid here: its daemon freed it or died; "
                                      "attach again",
    "cudaErrorMapBufferObjectFailed": "the slab's IPC handle could not be opened: attach from another process "
                                      "than the daemon, on the same host",
}


def format_uuid(raw: bytes) -> str:
    """A GPU's 16-byte UUID as nvidia-smi writes it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def check_uuid(text: str) -> str:
    """`text` if it is a GPU UUID as format_uuid writes it; InvalidRequestError otherwise."""
    if not isinstance(text, str) or not _UUID.fullmatch(text):
        raise InvalidRequestError(f"device_uuid {text[:60]!r} is not a GPU UUID (GPU-xxxxxxxx-...): the manifest "
                                  "is not one a preload daemon writes")
    return text


def check_handle(handle: bytes) -> bytes:
    """A manifest's IPC handle, which must be exactly 64 bytes."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise InvalidRequestError(f"a CUDA slab's handle has {IPC_HANDLE_BYTES} bytes, the manifest's has "
                                  f"{len(handle)}: the manifest is not one a preload daemon writes")
    return bytes(handle)


def ordinal_of(uuid: str, local_uuids: list[str], wanted: int | None = None) -> int:
    """This process's ordinal of the GPU `uuid` (CUDA_VISIBLE_DEVICES renumbers GPUs per process,
    so the daemon's cuda:N may be another number here). With `wanted` (the engine's own device),
    that ordinal must be the one holding it."""
    if uuid not in local_uuids:
        raise DeviceError(f"the slab lives on GPU {uuid}, which this process does not see (it sees "
                          f"{', '.join(local_uuids) or 'no GPU'}); run the engine with a CUDA_VISIBLE_DEVICES "
                          "that includes the daemon's GPU")
    found = local_uuids.index(uuid)
    if wanted is not None and wanted != found:
        raise DeviceError(f"the slab lives on GPU {uuid}, which is cuda:{found} in this process, not cuda:{wanted}; "
                          f"give this engine --devices cuda:{found} or start it with the daemon's "
                          "CUDA_VISIBLE_DEVICES")
    return found


def error_message(call: str, name: str, text: str) -> str:
    """What a failed CUDA call reports: the call, CUDA's name and words for the error, what to do."""
    hint = _HINTS.get(name, "")
    if call == "cudaMallocHost" and name == "cudaErrorMemoryAllocation":
        hint = "out of pinned host memory for the staging buffer: free host memory or load a smaller variant"
    return f"{call} failed: {name} ({text})" + (f"; {hint}" if hint else "")


def runtime():
    """cuda-python's runtime bindings; DeviceError naming the fix where they are not installed."""
    try:
        from cuda.bindings import runtime as rt  # cuda-python >= 12.6 (`from cuda import cudart` is gone in 13)
    except ImportError as e:
        raise DeviceError(f"cuda devices need cuda-python ({e}): install preload[gpu] (scripts/setup.sh does where "
                          "nvidia-smi works), or use cpu:N devices on this host") from None
    return rt


def call(name: str, *args):
    """rt.NAME(*args) with its error code checked: the remaining results (one value unwrapped)."""
    rt = runtime()
    try:
        result = getattr(rt, name)(*args)
    except Exception as e:  # cuda-python raises (not returns) when it cannot find the driver at all
        if type(e).__name__ == "DynamicLibNotFoundError":
            raise DeviceError(f"{name} failed: no NVIDIA driver on this host ({e}); use cpu:N devices here") from None
        raise
    err, values = result[0], result[1:]
    if err != rt.cudaError_t.cudaSuccess:
        err_name = rt.cudaGetErrorName(err)[1].decode()
        err_text = rt.cudaGetErrorString(err)[1].decode()
        raise DeviceError(error_message(name, err_name, err_text))
    return values[0] if len(values) == 1 else values


def device_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, by ordinal."""
    return [format_uuid(call("cudaGetDeviceProperties", i).uuid.bytes) for i in range(call("cudaGetDeviceCount"))]


def handle_bytes(handle) -> bytes:
    """The 64 bytes of a cudaIpcMemHandle_t (cuda-python exposes only its address)."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def handle_from_bytes(raw: bytes):
    handle = runtime().cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), check_handle(raw), IPC_HANDLE_BYTES)
    return handle


class _OpenedHandle:
    """Device memory opened from an IPC handle, as torch sees a CUDA array (torch.as_tensor makes
    views without a copy and keeps this object until the last of them is freed); the handle is
    closed when this object goes."""

    def __init__(self, pointer: int, size: int):
        self.pointer = pointer
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False), "version": 3}

    def __del__(self):
        try:
            call("cudaIpcCloseMemHandle", self.pointer)
        except Exception as e:  # at interpreter exit, or a context already torn down
            log.debug("closing an IPC handle: %s", e)


class CudaBackend:
    """Makes the slabs of a `cuda:N` daemon; probing the GPU when made, so that a daemon started for
    a GPU this host lacks fails at start with the reason, never falls back to host memory."""

    name = "cuda"

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        count = call("cudaGetDeviceCount")
        if not 0 <= ordinal < count:
            raise DeviceError(f"cuda:{ordinal} does not exist: this process sees {count} GPU(s) "
                              "(CUDA_VISIBLE_DEVICES renumbers them from 0)")
        self.uuid = format_uuid(call("cudaGetDeviceProperties", ordinal).uuid.bytes)

    def create(self, label: str, size: int) -> "CudaSlab":
        return CudaSlab(self, label, size)


class CudaSlab:
    backend = "cuda"
    adoptable = False

    def __init__(self, owner: CudaBackend, label: str, size: int):
        self.owner, self.size, self.digest = owner, size, ""
        self.id = f"{label[:80]}-{secrets.token_hex(6)}"
        self._use = threading.Lock()
        call("cudaSetDevice", owner.ordinal)
        self._pointer = call("cudaMalloc", size)
        try:
            call("cudaMemset", self._pointer, 0, size)  # padding reads as zeros, as in host slabs
            self._staging = call("cudaMallocHost", size)
        except BaseException:
            call("cudaFree", self._pointer)
            raise
        self.data = torch.frombuffer((ctypes.c_uint8 * size).from_address(self._staging), dtype=torch.uint8)
        self.data.zero_()
        self._handle = b""

    def allocated(self, end: int) -> int:
        return self.size  # the staging buffer is pinned and zeroed whole at creation

    def seal(self, digest: str) -> None:
        """Copies the staged bytes to the device, frees the staging buffer, exports the handle."""
        rt = runtime()
        call("cudaSetDevice", self.owner.ordinal)
        for start in range(0, self.size, COPY_CHUNK):
            n = min(COPY_CHUNK, self.size - start)
            call("cudaMemcpy", self._pointer + start, self._staging + start, n,
                 rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
        self._free_staging()
        self._handle = handle_bytes(call("cudaIpcGetMemHandle", self._pointer))
        self.digest = digest

    def hash(self) -> str:
        """The digest of the bytes as they are now: the staging buffer's while filling, the
        device memory's (copied back in chunks) once sealed; "" once freed."""
        from preload_daemon.slab import DIGEST_ALGORITHM, new_hasher
        rt = runtime()
        hasher = new_hasher()
        with self._use:
            if self._pointer is None:
                return ""
            if self.data is not None:
                hasher.update(memoryview(self.data.numpy()))
            else:
                call("cudaSetDevice", self.owner.ordinal)
                chunk = min(COPY_CHUNK, self.size)
                bounce = call("cudaMallocHost", chunk)
                try:
                    view = (ctypes.c_uint8 * chunk).from_address(bounce)
                    for start in range(0, self.size, COPY_CHUNK):
                        n = min(COPY_CHUNK, self.size - start)
                        call("cudaMemcpy", bounce, self._pointer + start, n, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
                        hasher.update(memoryview(view)[:n])
                finally:
                    call("cudaFreeHost", bounce)
        return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"

    def export(self) -> dict:
        """The manifest's description of this slab (pb.Slab fields besides id, backend, size, digest)."""
        return {"handle": self._handle, "device_uuid": self.owner.uuid}

    def unlink(self) -> None:
        """Nothing on disk to remove."""

    def close(self) -> None:
        """Frees the device memory. Workers that opened its handle keep it mapped until they close it."""
        with self._use:
            self._free_staging()
            if self._pointer is not None:
                call("cudaSetDevice", self.owner.ordinal)
                call("cudaFree", self._pointer)
                self._pointer = None

    def _free_staging(self) -> None:
        if self.data is not None:
            self.data = None
            call("cudaFreeHost", self._staging)


def open_ipc(handle: bytes, uuid: str, size: int, wanted: int | None = None) -> torch.Tensor:
    """A CUDA slab opened in a client: its `size` bytes as a uint8 tensor on this process's ordinal
    of the GPU `uuid` (which must be cuda:`wanted` where given), without a copy; the handle is
    closed with the last view of it."""
    check_handle(handle)  # the manifest's fields are checked before any CUDA call
    check_uuid(uuid)
    if not torch.cuda.is_available():
        raise DeviceError("this slab is in GPU memory, and torch here has no CUDA (a CPU build, or no driver): "
                          "attach from a process with a CUDA build of torch on the daemon's host")
    ordinal = ordinal_of(uuid, device_uuids(), wanted)
    call("cudaSetDevice", ordinal)
    opened = _OpenedHandle(call("cudaIpcOpenMemHandle", handle_from_bytes(handle),
                                runtime().cudaIpcMemLazyEnablePeerAccess), size)
    with torch.cuda.device(ordinal):  # a failure here closes the handle with `opened`
        return torch.as_tensor(opened, device=f"cuda:{ordinal}")
