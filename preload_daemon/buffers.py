"""Read-only mappings of files and typed tensor views into them, shared by the checkpoint reader
and the client that maps slabs."""

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import pathlib
import stat
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


def open_slab_file(path: pathlib.Path) -> int:
    """A descriptor of a slab file a manifest names: a regular file of this user's (or root's, a
    daemon run as root), never a symlink (ValueError saying what it is otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symlink, so it is no slab file") from None
        raise
    info = os.fstat(fd)
    problem = "is not a regular file" if not stat.S_ISREG(info.st_mode) else \
        f"belongs to uid {info.st_uid}, not to this user" if info.st_uid not in (os.getuid(), 0) else ""
    if problem:
        os.close(fd)
        raise ValueError(f"{path} {problem}, so it is no slab file")
    return fd


def map_readonly(path: pathlib.Path) -> mmap.mmap | None:
    """Maps a whole slab file read-only (PROT_READ); None for an empty file, which mmap refuses."""
    fd = open_slab_file(path)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE, _MAP_POPULATE = 0, 0x10, 0x4000, 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap_fixed(address: int, size: int, prot: int, flags: int, fd: int) -> None:
    if _libc.mmap(address, size, prot, flags | _MAP_FIXED, fd, 0) in (_MAP_FAILED, None):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {address:#x} ({size} bytes): {os.strerror(err)}")


def park_mapping(address: int, size: int) -> None:
    """Replaces the mapping at [address, address + size) with an inaccessible, unbacked reservation
    of the same range: the file it mapped is let go, nothing else can be placed there, and every
    view into it stays a valid object (reading one would fault, so nothing may until it is
    remapped). What a process snapshot needs: the range holds no pages and names no file."""
    _mmap_fixed(address, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)


def remap_readonly(path: pathlib.Path, address: int, size: int) -> int:
    """Maps `path` (exactly `size` bytes) read-only at `address`, in place of a parked range; views
    made before read the file from now on. The page tables are filled now (MAP_POPULATE): the first
    forward after a restore runs without faulting its way through the weights. Returns the open
    descriptor (the caller closes it)."""
    fd = open_slab_file(path)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes, not the {size} mapped before")
        _mmap_fixed(address, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_POPULATE, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = mmap.PAGESIZE
_populates = True  # until the kernel says it cannot


def populate(view: memoryview) -> None:
    """Faults in the whole pages within `view` (a writable, contiguous byte buffer) ahead of a write
    that fills them, in one system call (MADV_POPULATE_WRITE): the kernel then allocates the pages
    in a loop of its own, where a write into memory not yet touched traps once a page. A read from
    the page cache into fresh private memory ran 1.2-1.45x as fast with it (2-core Zen 4 VM, 1 GiB in
    chunks of 1-16 MiB, 1 and 2 threads; a shared-memory file 1.1x). The pages at either end, which
    the buffer may share with its neighbours, are left to the write. Nothing where the kernel lacks
    it (before 5.14) or the buffer is read-only: the write faults the pages in as before. Lets go of
    the GIL (ctypes) while it runs."""
    global _populates
    if not _populates or len(view) < 2 * _PAGE:
        return
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only or not contiguous
        return
    start, end = -(-address // _PAGE) * _PAGE, (address + len(view)) // _PAGE * _PAGE
    if end > start and _libc.madvise(start, end - start, _MADV_POPULATE_WRITE) and ctypes.get_errno() == errno.EINVAL:
        _populates = False


# glibc's mallopt parameters (malloc.h), and what its malloc is told to keep while a load quantizes.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 16 << 20  # blocks below this come from the heap (kernels.quant's passes: 4 MiB)
HEAP_TRIM_THRESHOLD = 64 << 20  # free memory the heap keeps at its top between them
_heap_lock = threading.Lock()
_heap_users = 0
_heap_set = False
if hasattr(_libc, "malloc_trim"):
    _libc.malloc_trim.argtypes = (ctypes.c_size_t,)


@contextlib.contextmanager
def heap_kept():
    """Keeps freed memory in glibc's heap while a load quantizes, and hands it back after. Each
    weight is quantized through float32 temporaries of up to a few MiB (kernels.quant), all freed
    before the next weight. Left alone, glibc maps blocks that large afresh (its threshold rises only
    to the largest block freed so far) and gives the heap's top back once twice that is free, so
    weight after weight the temporaries were faulted in anew, a page at a time: the default model's
    int8 cold load faulted in 5.0-5.3 times as many pages as its destination holds (now 1.06-1.16),
    and took 1.8x the time (2-core Zen 4, medians: int8 440 -> 243 ms, fp8_per_channel 413 -> 293,
    mxfp8 713 -> 362, nvfp4 1014 -> 719). The thresholds stay set for the process (glibc cannot be
    put back to adjusting them itself; these lie within the range it adjusts them in); when the last
    quantizing load ends, malloc_trim hands back what the heaps hold free. Nothing where the C
    library has no mallopt (not glibc)."""
    global _heap_users, _heap_set
    with _heap_lock:
        if not _heap_set and hasattr(_libc, "mallopt"):
            _libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
            _libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
        _heap_set = True
        _heap_users += 1
    try:
        yield
    finally:
        with _heap_lock:
            _heap_users -= 1
            if not _heap_users and hasattr(_libc, "malloc_trim"):
                _libc.malloc_trim(0)


def descriptors_of(path: str) -> list[int]:
    """This process's open descriptors of the file at `path` (also once it was unlinked)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target in (path, f"{path} (deleted)"):
            found.append(int(name))
    return found


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
            return torch.empty(shape, dtype=dtype, device=self.raw.device)
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
