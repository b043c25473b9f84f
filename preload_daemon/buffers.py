"""Read-only mappings of files and typed tensor views into them, shared by the checkpoint reader
and the client that maps slabs."""

import contextlib
import gc
import mmap
import os
import pathlib
import threading
import warnings

import torch

# Names as they travel in manifests (torch's own, without the "torch." prefix).
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.uint16, torch.uint32, torch.uint64,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
    )
}


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused():
    """Holds off the cyclic garbage collector (as a decorator too). Its passes are triggered by
    allocation counts and walk every live object: making tens of thousands of objects that all stay
    (a header's entries, a load plan) sets off pass after pass, several
    microseconds per tensor, and finds nothing to free. Nested and concurrent pauses are counted;
    the last one out re-enables it, unless it was off before the first."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if not _gc_pausers:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if not _gc_pausers and _gc_was_enabled:
                gc.enable()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPES))}") from None


def map_readonly(path: pathlib.Path) -> mmap.mmap | None:
    """Maps a whole file read-only (PROT_READ); None for an empty file, which mmap refuses."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)


def bytes_tensor(buffer) -> torch.Tensor:
    """A uint8 tensor over a buffer without copying. Read-only buffers are fine: torch warns that
    writes would be undefined, and nothing here writes (the mapping would fault if it did)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buffer, dtype=torch.uint8)


class SlabViews:
    """Typed views into one flat uint8 buffer, each made by a single as_strided call on a flat view
    of the buffer in that dtype (kept per dtype): about a microsecond per tensor."""

    __slots__ = ("raw", "_flat", "_strides")

    def __init__(self, raw: torch.Tensor):
        self.raw = raw
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._strides: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}  # shape: (strides, numel)

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        known = self._strides.get(shape)
        if known is None:
            known = self._strides[shape] = _contiguous(shape)
        strides, numel = known
        size = dtype.itemsize
        if offset % 64 or numel * size != nbytes or offset + nbytes > self.raw.numel() or numel < 0:
            raise ValueError(f"bad tensor placement: {nbytes} bytes of {dtype} {list(shape)} at offset {offset} "
                             f"in a {self.raw.numel()}-byte slab")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        flat = self._flat.get(dtype)
        if flat is None:
            flat = self._flat[dtype] = self.raw[:self.raw.numel() // size * size].view(dtype)
        return flat.as_strided(shape, strides, offset // size)


def _contiguous(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Row-major strides of `shape` and its element count (-1 if a dimension is negative)."""
    strides, step = [], 1
    for d in reversed(shape):
        if d < 0:
            return (), -1
        strides.append(step)
        step *= d
    return tuple(reversed(strides)), step
