"""A host slab's memory is reserved on a thread of its own while its load writes behind it: the load
never writes past what is reserved, and a /dev/shm that fills up partway fails the load with a clear
error, leaving nothing behind and what was loaded before serving."""

import ctypes
import errno
import os

import pytest
import torch

from preload_daemon import slab as slabs
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import InvalidRequestError
from preload_daemon.execute import execute
from preload_daemon.plan import LoadSpec, build_plan
from preload_daemon.store import ModelStore
from tests.conftest import me

CHUNK = 64 << 10  # a small ALLOCATE_CHUNK, so that the tiny model's slab takes several


def test_execute_writes_nothing_past_what_ready_allowed(tiny_llama):
    checkpoint = Checkpoint(tiny_llama)
    plan = build_plan(checkpoint, LoadSpec(path=str(tiny_llama)))
    assert plan.total_bytes > 4 * CHUNK
    free = torch.empty(plan.total_bytes, dtype=torch.uint8)
    execute(plan, checkpoint, free)
    dest = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    allowed, asked, past = [0], [], []

    def ready(end: int) -> int:  # as a slab allocated a chunk at a time would answer
        asked.append(end)
        allowed[0] = max(allowed[0], min(plan.total_bytes, -(-end // CHUNK) * CHUNK))
        return allowed[0]

    read_many = checkpoint.read_many

    def watched(reads):
        for _, view, _ in reads:
            if len(view):
                end = ctypes.addressof(ctypes.c_char.from_buffer(view)) + len(view) - dest.data_ptr()
                if end > allowed[0]:
                    past.append(end)
        read_many(reads)

    checkpoint.read_many = watched
    execute(plan, checkpoint, dest, ready=ready)
    assert not past, f"wrote up to {past[:3]} with only {allowed[0]} allowed"
    assert asked == sorted(asked) and asked[-1] == plan.total_bytes and len(asked) < len(plan.entries)
    assert dest.equal(free)


def test_a_dev_shm_that_fills_up_partway_fails_the_load_and_keeps_what_was_loaded(tmp_path, tiny_llama,
                                                                                   monkeypatch):
    shm = tmp_path / "shm"
    store = ModelStore("cpu:0", shm)
    store.load(LoadSpec(path=str(tiny_llama), name="kept"))
    kept = {p.name for p in shm.iterdir()}
    real, reserved = os.posix_fallocate, []

    def full_after_two_chunks(fd, offset, length):
        if offset >= 2 * CHUNK:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserved.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(slabs, "ALLOCATE_CHUNK", CHUNK)
    monkeypatch.setattr(os, "posix_fallocate", full_after_two_chunks)
    with pytest.raises(InvalidRequestError, match=r"stopped at byte 131072\): \[Errno 28\] No space left on device; "
                                                  r"free space in /dev/shm or evict a model"):
        store.load(LoadSpec(path=str(tiny_llama), name="lost", dtype="bfloat16"))
    assert reserved == [(0, CHUNK), (CHUNK, CHUNK)]
    assert {p.name for p in shm.iterdir()} == kept
    assert [(m.name, sorted(m.versions)) for m in store.models()] == [("kept", [1]), ("lost", [])]
    variant, _ = store.attach("kept", me())
    assert variant.slab.hash() == variant.slab.digest

    monkeypatch.setattr(os, "posix_fallocate", real)  # space again: the same load goes through
    store.load(LoadSpec(path=str(tiny_llama), name="lost", dtype="bfloat16"))
    variant, _ = store.attach("lost", me())
    assert variant.slab.hash() == variant.slab.digest and variant.slab.size > 2 * CHUNK


def test_a_slab_closed_while_it_is_allocated_stops_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(slabs, "ALLOCATE_CHUNK", CHUNK)
    slab = slabs.HostSlab.create(tmp_path / "shm", "closed", 64 * CHUNK)
    assert slab.allocated(CHUNK) >= CHUNK
    slab.close()
    slab.unlink()
    assert not list((tmp_path / "shm").iterdir())
    with pytest.raises(InvalidRequestError, match="closed while it was being allocated"):
        slab.allocated(64 * CHUNK + 1)


def test_two_slabs_that_each_fit_alone_are_not_both_started_when_only_one_fits(tmp_path, monkeypatch):
    """Two loads of 257 MiB with 443 MiB free: both started, their reservations interleaved, and both
    failed part-way. Room that loads under way still have to reserve is counted as taken."""
    import threading
    import types
    release, real = threading.Event(), os.posix_fallocate

    def slow(fd, offset, length):  # the first slab's reservation is under way
        release.wait(30)
        real(fd, offset, length)

    monkeypatch.setattr(slabs, "ALLOCATE_CHUNK", CHUNK)
    monkeypatch.setattr(slabs.shutil, "disk_usage", lambda _: types.SimpleNamespace(free=12 * CHUNK))
    monkeypatch.setattr(os, "posix_fallocate", slow)
    first = slabs.HostSlab.create(tmp_path / "shm", "first", 8 * CHUNK)
    try:
        with pytest.raises(InvalidRequestError, match=r"does not fit in .* GiB free, 0\.00 GiB of it promised to "
                                                      r"loads under way\); .*or load it after them"):
            slabs.HostSlab.create(tmp_path / "shm", "second", 8 * CHUNK)
    finally:
        release.set()
    assert first.allocated(8 * CHUNK) == 8 * CHUNK
    second = slabs.HostSlab.create(tmp_path / "shm", "second", 8 * CHUNK)  # once the first one has its room
    for slab in (first, second):
        slab.close()
        slab.unlink()


def test_a_client_maps_no_symlink_or_other_file_planted_at_a_slabs_name(tmp_path):
    """A manifest's path was opened following symlinks, whatever it named."""
    real = tmp_path / "real.slab"
    real.write_bytes(bytes(4096))
    (tmp_path / "link.slab").symlink_to(real)
    os.mkfifo(tmp_path / "fifo.slab")
    for name, problem in (("link", "is a symlink"), ("fifo", "is not a regular file")):
        with pytest.raises(InvalidRequestError, match=f"{name}.slab {problem}.*tampered with: `preload verify`"):
            slabs.map_slab(str(tmp_path / f"{name}.slab"), 4096)
    assert slabs.map_slab(str(real), 4096).numel() == 4096
