"""Slab backends behind one small interface (`Slab`, `backend_for`, `open_slab`): the store, the
manifest and the loaders never ask which one they hold.

- host (cpu:N): one shared-memory file per slab in a private directory under /dev/shm. The daemon
  writes a slab once, hashing it as it goes, then seals it read-only; clients map it read-only; a
  restarted daemon adopts it (adopt.py).
- cuda (cuda:N): device memory exported as a CUDA IPC handle (preload_daemon/cuda.py)."""

import mmap
import os
import pathlib
import secrets
import shutil
import threading
from typing import Protocol

import torch

from preload_daemon.buffers import bytes_tensor, map_readonly
from preload_daemon.config import cuda_ordinal
from preload_daemon.errors import DeviceError, InvalidRequestError, NotFoundError
from preload_daemon.runtime_dir import ensure_private_dir
from protos import preload_pb2 as pb

DIGEST_ALGORITHM = "xxh3_128"
ALLOCATE_CHUNK = 64 << 20  # bytes a new host slab's allocation reserves at a time
HASH_CHUNK = 64 << 20  # bytes hashed between checks that a host slab's file is whole


class SlabGoneError(DeviceError):
    """A host slab's file is no longer whole: `reason` as HostSlab.gone says it."""

    def __init__(self, path: pathlib.Path, reason: str):
        super().__init__(f"the slab file {path} was {reason} behind the daemon's back; evict its version "
                         "(--force) and load it again, and find what writes to /dev/shm")
        self.reason = reason


def new_hasher():
    import xxhash  # imported here: clients that only map slabs never need it
    return xxhash.xxh3_128()


class Slab(Protocol):
    """One slab the daemon owns, whatever holds it."""

    backend: str
    """The manifest's name for the backend: "host" or "cuda"."""
    adoptable: bool
    """Whether it outlives the daemon, for the next one to adopt (a record is written beside it)."""
    id: str
    size: int
    digest: str
    data: torch.Tensor | None
    """Writable host bytes while it is filled (the load plan's destination); None once it cannot be."""

    def allocated(self, end: int) -> int:
        """Waits until `data`'s bytes [0, end) are backed by memory, and returns how far they are (at
        least `end`); raises InvalidRequestError if they cannot be. Every write below `end` waits for it."""

    def seal(self, digest: str) -> None:
        """Marks it written, with the digest of what was written; readers may attach from now on."""

    def hash(self) -> str:
        """The digest of its bytes as they are now ("" once freed)."""

    def export(self) -> dict:
        """What a client needs to open it: the manifest's pb.Slab fields besides id, backend, size, digest."""

    def close(self) -> None:
        """Lets go of its memory (clients that opened it keep theirs until they close)."""

    def unlink(self) -> None:
        """Removes what it left on disk."""


class HostBackend:
    """Makes the slabs of a cpu:N daemon."""

    name = "host"

    def __init__(self, directory: pathlib.Path):
        self.directory = directory

    def create(self, label: str, size: int) -> "HostSlab":
        return HostSlab.create(self.directory, label, size)


def backend_for(device: str, shm_dir: pathlib.Path):
    """The backend of a daemon for `device` ("cpu:N": host; "cuda:N": cuda, which raises DeviceError
    with the reason where this host cannot hold GPU slabs, never falling back to host memory)."""
    ordinal = cuda_ordinal(device)
    if ordinal is not None:
        from preload_daemon import cuda
        return cuda.CudaBackend(ordinal)
    return HostBackend(shm_dir)


class HostSlab:
    """A shared-memory file the daemon owns. `data` is a writable uint8 view until `seal()`."""

    backend = "host"
    adoptable = True

    def __init__(self, path: pathlib.Path, size: int, mapping: mmap.mmap):
        self.path = path
        self.size = size
        self.id = path.stem
        self.digest = ""
        self._mapping = mapping
        self._use = threading.Lock()
        self._hashing, self._close_when_hashed = 0, False
        self.data = bytes_tensor(mapping)
        self._inode = os.stat(path).st_ino
        self._allocation: _Allocation | None = None  # a new slab's, until sealed or closed

    def gone(self) -> str:
        """Why the file at the slab's path is no longer the one the daemon mapped, whole ("" while it
        is): deleted, replaced or resized behind the daemon's back (by this uid or root: the directory
        is ours). A page of the mapping past a truncated file's end faults (SIGBUS) when read."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return "deleted"
        if info.st_ino != self._inode:
            return "replaced by another file"
        if info.st_size != self.size:
            return f"{'truncated' if info.st_size < self.size else 'grown'} to {info.st_size} bytes from {self.size}"
        return ""

    @classmethod
    def create(cls, directory: pathlib.Path, label: str, size: int) -> "HostSlab":
        """A new zero-filled slab of `size` bytes. The name is unique (random suffix). Its memory is
        reserved on a thread of its own (_Allocation), which a load writes behind: allocated() says
        how far it is, and a full /dev/shm fails there with a clear error, never a SIGBUS."""
        ensure_private_dir(directory)
        with _Allocation.starting:  # the room and the loads under way, looked at and joined at once
            free, promised = shutil.disk_usage(directory).free, _Allocation.outstanding()
            if size > free - promised:
                under_way = f", {promised / 2**30:.2f} GiB of it promised to loads under way" if promised else ""
                raise InvalidRequestError(f"slab of {size / 2**30:.2f} GiB does not fit in {directory} "
                                          f"({free / 2**30:.2f} GiB free{under_way}); evict a model or enlarge /dev/shm"
                                          f"{', or load it after them' if promised else ''}")
            safe_label = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:80]
            path = directory / f"{safe_label}-{secrets.token_hex(6)}.slab"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                slab = cls(path, size, mapping)
                slab._allocation = _Allocation(fd, size, directory)
            except (OSError, ValueError, RuntimeError) as e:  # mmap of an empty file; no thread to reserve it
                path.unlink(missing_ok=True)
                raise InvalidRequestError(f"cannot allocate a {size}-byte slab in {directory}: {e}; "
                                          "free space in /dev/shm or evict a model") from e
            finally:
                os.close(fd)
        return slab

    @classmethod
    def open(cls, path: pathlib.Path, size: int, digest: str, fd: int) -> "HostSlab":
        """A sealed slab a previous daemon left (adopt.py), mapped read-only from `fd`."""
        slab = cls(path, size, mmap.mmap(fd, size, prot=mmap.PROT_READ))
        slab.digest = digest
        return slab

    def allocated(self, end: int) -> int:
        return self._allocation.wait(end) if self._allocation is not None else self.size

    def seal(self, digest: str) -> None:
        """Marks the slab written: the file becomes read-only (0400) and keeps its digest."""
        self.allocated(self.size)
        self._allocation = None
        self.digest = digest
        os.chmod(self.path, 0o400)

    def hash(self, through_file: bool = False) -> str:
        """The digest of the slab's bytes as they are now ("" if the slab was freed); SlabGoneError
        where its file is not whole (gone()), checked before each HASH_CHUNK of the mapping: reading it
        past a truncated file's end kills the process (SIGBUS). `through_file` (`preload verify`)
        reads the file instead, where a truncation is a short read, never a signal, even one made while
        the hash runs; it costs a copy (about 5x the mapping's time: 60 against 11 ms for 0.26 GB on a
        2-core Zen 4). A close() while hashing is carried out when the hash is done: the mapping never
        goes away under the hasher, and the closer (the store, under its lock) never waits for it."""
        with self._use:
            if self.data is None:
                return ""
            self._hashing += 1
        try:
            hasher = new_hasher()
            if through_file:
                self._hash_file(hasher)
            else:
                view = memoryview(self.data.numpy())
                for start in range(0, self.size, HASH_CHUNK):
                    if gone := self.gone():
                        raise SlabGoneError(self.path, gone)
                    hasher.update(view[start:start + HASH_CHUNK])
            return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"
        finally:
            with self._use:
                self._hashing -= 1
                if self._close_when_hashed and not self._hashing:
                    self._unmap()

    def _hash_file(self, hasher) -> None:
        """Hashes the slab's file (the inode the daemon mapped) with reads into one buffer."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            raise SlabGoneError(self.path, self.gone() or "made unreadable") from None
        try:
            if os.fstat(fd).st_ino != self._inode:
                raise SlabGoneError(self.path, "replaced by another file")
            buffer = bytearray(min(HASH_CHUNK, max(self.size, 1)))
            view, done = memoryview(buffer), 0
            while done < self.size:
                n = os.preadv(fd, [view[:min(len(buffer), self.size - done)]], done)
                if n <= 0:
                    raise SlabGoneError(self.path, f"truncated to {done} bytes from {self.size}")
                hasher.update(view[:n])
                done += n
        finally:
            os.close(fd)

    def export(self) -> dict:
        return {"path": str(self.path)}

    def unlink(self) -> None:
        """Removes the file and its record. Processes that mapped it keep their pages until they unmap."""
        self.path.unlink(missing_ok=True)
        self.path.with_name(self.path.name + ".json").unlink(missing_ok=True)

    def close(self) -> None:
        if self._allocation is not None:
            self._allocation.stop()
        with self._use:
            if self._hashing:
                self._close_when_hashed = True
            else:
                self._unmap()

    def _unmap(self) -> None:
        self.data = None
        self._mapping.close()


class _Allocation:
    """A new slab file's memory reserved (posix_fallocate) on a thread of its own, ALLOCATE_CHUNK at a
    time in order, while the load writes behind it: the two overlap, where one after the other the
    reservation had taken about as long as the load's reads (1 GiB from the page cache on a 2-core
    Zen 4 VM: 0.23-0.32 s, one thread at a time whatever the threads). A write into a page past it
    would have the page allocated there and then, with a SIGBUS if /dev/shm were full by then:
    writers wait for it (HostSlab.allocated) instead."""

    starting = threading.Lock()
    """Held while a slab's room is checked and its allocation starts (HostSlab.create): two loads that
    each fit alone, started together, both failed part-way, their reservations interleaved."""
    _running_now: set["_Allocation"] = set()

    def __init__(self, fd: int, size: int, directory: pathlib.Path):
        self._fd, self._size, self._directory = os.dup(fd), size, directory
        self._done, self._error, self._running, self._stopping = 0, "", True, False
        self._changed = threading.Condition()
        _Allocation._running_now.add(self)
        try:
            threading.Thread(target=self._run, name="slab-allocate", daemon=True).start()
        except BaseException:  # ("can't start new thread"): not counted as under way for good
            _Allocation._running_now.discard(self)
            os.close(self._fd)
            raise

    @classmethod
    def outstanding(cls) -> int:
        """Bytes this process's allocations under way have still to reserve."""
        return sum(a._size - a._done for a in list(cls._running_now))

    def _run(self) -> None:
        try:
            while self._done < self._size and not self._stopping:
                n = min(ALLOCATE_CHUNK, self._size - self._done)
                os.posix_fallocate(self._fd, self._done, n)  # lets go of the GIL
                with self._changed:
                    self._done += n
                    self._changed.notify_all()
        except OSError as e:
            self._error = (f"cannot allocate a {self._size}-byte slab in {self._directory} (stopped at byte "
                           f"{self._done}): {e}; free space in /dev/shm or evict a model")
        finally:
            os.close(self._fd)
            _Allocation._running_now.discard(self)
            with self._changed:
                self._running = False
                self._changed.notify_all()

    def wait(self, end: int) -> int:
        """How far the slab is allocated, once that is at least `end`; InvalidRequestError if it cannot be."""
        with self._changed:
            while self._done < end and self._running:
                self._changed.wait()
            if self._done < end:
                raise InvalidRequestError(self._error or "the slab was closed while it was being allocated")
            return self._done

    def stop(self) -> None:
        """Stops after the chunk under way, and waits for that."""
        with self._changed:
            self._stopping = True
            while self._running:
                self._changed.wait()


def slab_gone(slab) -> str:
    """Why a slab's file is not the one its daemon mapped, whole ("" if it is, or if it has no file)."""
    gone = getattr(slab, "gone", None)
    return gone() if gone is not None else ""


def rehash(slab) -> str:
    """A slab's digest now, or "gone: file ..." where its file is not whole (`preload verify`)."""
    try:
        if gone := slab_gone(slab):
            return f"gone: file {gone}"
        return slab.hash(through_file=True) if isinstance(slab, HostSlab) else slab.hash()
    except SlabGoneError as e:
        return f"gone: file {e.reason}"


def map_slab(path: str, size: int) -> torch.Tensor:
    """A read-only uint8 view of a host slab of `size` bytes (PROT_READ: a write faults)."""
    try:
        mapping = map_readonly(pathlib.Path(path))
    except FileNotFoundError:
        raise NotFoundError(f"slab {path} is gone (evicted, or its daemon was restarted); attach again") from None
    except ValueError as e:  # something else planted at its name
        raise InvalidRequestError(f"{e}; the daemon's slab directory was tampered with: `preload verify`") from None
    if mapping is None or len(mapping) != size:
        raise InvalidRequestError(f"slab {path} has {len(mapping) if mapping else 0} bytes, manifest says {size}")
    return bytes_tensor(mapping)


def open_slab(slab: pb.Slab, device: str | None = None) -> torch.Tensor:
    """A client's opening of a manifest's slab: its bytes as a uint8 tensor (read-only host memory,
    or device memory), let go of with the last view of it. `device`: the client's own ("cuda:N"),
    which a CUDA slab's GPU must be."""
    if slab.backend == "host":
        return map_slab(slab.path, slab.size)
    if slab.backend == "cuda":
        from preload_daemon import cuda
        return cuda.open_ipc(slab.handle, slab.device_uuid, slab.size, cuda_ordinal(device) if device else None)
    raise DeviceError(f"slab {slab.id[:80]!r} uses backend {slab.backend[:40]!r}, which this client does not know "
                      "(host and cuda): upgrade preload on this side")
