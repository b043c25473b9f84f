import ctypes
import json
import mmap
import os
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import preload_daemon.checkpoint as checkpoint_module
from preload_daemon.checkpoint import READ_AHEAD_WINDOW, Checkpoint, refresh_identity
from preload_daemon.errors import CheckpointError
from preload_daemon.safetensors_file import read_header
from tests.conftest import wait_until

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
          "intermediate_size": 16, "vocab_size": 32, "num_hidden_layers": 1}


def write_raw(path, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def make_dir(tmp_path, tensors=None):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors or {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.int8)},
              str(tmp_path / "model.safetensors"))
    return tmp_path


def test_reads_tensors_bitwise_equal_to_safetensors(tmp_path):
    """Lazy reads of every dtype give the same bytes as the safetensors library."""
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "i64": torch.arange(9),
               "f8": torch.randn(4, 4).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 3)}
    make_dir(tmp_path, tensors)
    ckpt = Checkpoint(tmp_path)
    ref = load_file(str(tmp_path / "model.safetensors"))
    assert set(ckpt.tensors) == set(ref)
    for name, tensor in ref.items():
        got = ckpt.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(torch.uint8) if got.numel() else got, tensor.view(torch.uint8) if got.numel() else tensor)


def test_tensors_stored_back_to_back_are_read_in_one_call_whatever_each_call_returns(tmp_path, monkeypatch):
    """read_many fills each destination with its tensor's bytes (from a skip on, too; an empty tensor
    among them), reading a run of tensors that follow one another in the file with one preadv, and
    resumes wherever a short read stopped, within a buffer or across several; a read past a tensor's
    end is refused, and a file cut short after it was opened is named, not read as zeros."""
    tensors = {f"t{i:02}": torch.randn(3 + i) for i in range(40)} | {"t20": torch.zeros(0)}
    make_dir(tmp_path, tensors)
    ckpt = Checkpoint(tmp_path)
    order = sorted(ckpt.tensors, key=lambda n: (ckpt.tensors[n].start, ckpt.tensors[n].nbytes))
    real_preadv = os.preadv
    skip = {"t05": 4, "t33": 9}
    for most in (None, 7, 13):  # bytes a call returns at most: 7 and 13 end calls inside and across buffers
        def preadv(fd, buffers, offset, most=most):
            if most is None:
                return real_preadv(fd, buffers, offset)
            left, parts = most, []
            for buffer in buffers:
                parts.append(memoryview(buffer)[:left])
                left -= len(parts[-1])
                if not left:
                    break
            return real_preadv(fd, parts, offset)
        monkeypatch.setattr(os, "preadv", preadv)
        outs = {name: bytearray(ckpt.tensors[name].nbytes - skip.get(name, 0)) for name in order}
        ckpt.read_many([(name, memoryview(outs[name]), skip.get(name, 0)) for name in order])
        for name in order:
            assert bytes(outs[name]) == tensors[name].view(torch.uint8).numpy().tobytes()[skip.get(name, 0):], name
    counted = []
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: (counted.append(len(buffers)),
                                                                    real_preadv(fd, buffers, offset))[1])
    ckpt.read_many([(name, memoryview(bytearray(ckpt.tensors[name].nbytes)), 0) for name in order])
    assert counted == [len(order) - 1]  # back to back: one call for all 40 (the empty one takes no buffer)
    spaced = [name for name in order if ckpt.tensors[name].nbytes][::2]
    ckpt.read_many([(name, memoryview(bytearray(ckpt.tensors[name].nbytes)), 0) for name in spaced])
    assert counted[1:] == [1] * len(spaced)  # gaps between them: one call each
    with pytest.raises(ValueError, match="run past"):
        ckpt.read_many([("t00", memoryview(bytearray(12)), 0), ("t01", memoryview(bytearray(17)), 0)])
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(ckpt.tensors[order[-1]].start + 2)
    with pytest.raises(CheckpointError, match="ends early"):
        ckpt.read_many([(name, memoryview(bytearray(ckpt.tensors[name].nbytes)), 0) for name in order])


def test_a_column_shard_is_read_row_by_row_whatever_each_call_returns(tmp_path, monkeypatch):
    """read_strided fills its buffer with each row's slice of columns, through short reads too; a
    slice past the tensor's end is refused, and a file cut short after it was opened is named."""
    weight = torch.randn(9, 12)
    make_dir(tmp_path, {"w": weight, "after": torch.ones(3)})
    ckpt = Checkpoint(tmp_path)
    real_preadv = os.preadv
    for most in (None, 5, 11):
        monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset, most=most: real_preadv(
            fd, buffers if most is None else [memoryview(buffers[0])[:most]], offset))
        for start, length in ((0, 6), (6, 6), (4, 3), (0, 12)):
            out = bytearray(9 * length * 4)
            ckpt.read_strided("w", memoryview(out), start * 4, length * 4, 12 * 4)
            assert torch.equal(torch.frombuffer(out, dtype=torch.float32).view(9, length),
                               weight[:, start:start + length]), (most, start, length)
    monkeypatch.setattr(os, "preadv", real_preadv)
    for skip, width, stride, size in ((28, 24, 48, 9 * 24), (0, 24, 48, 24 * 10), (0, 0, 48, 0), (0, 48, 24, 96)):
        with pytest.raises(ValueError, match="do not fit"):
            ckpt.read_strided("w", memoryview(bytearray(size)), skip, width, stride)
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(ckpt.tensors["w"].start + 5 * 48)
    with pytest.raises(CheckpointError, match="ends early"):
        ckpt.read_strided("w", memoryview(bytearray(9 * 24)), 24, 24, 48)


def test_sharded_checkpoint_with_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file({"x": torch.ones(2)}, str(tmp_path / "part-1.safetensors"))
    save_file({"y": torch.zeros(3)}, str(tmp_path / "part-2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "part-1.safetensors", "y": "part-2.safetensors"}}))
    ckpt = Checkpoint(tmp_path)
    assert [f.path.rsplit("/", 1)[1] for f in ckpt.identity] == ["part-1.safetensors", "part-2.safetensors"]
    assert torch.equal(ckpt.read("y"), torch.zeros(3))


def _cached_pages(path) -> float:
    """The share of `path`'s pages in the page cache (mincore on a mapping of it, which reads
    nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = ctypes.create_string_buffer((size + page - 1) // page)
        try:
            assert libc.mincore(address, size, pages) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in pages.raw) / len(pages.raw)


def test_read_ahead_brings_every_file_into_the_page_cache_within_its_bound_and_stops_when_asked(tmp_path,
                                                                                                monkeypatch):
    """A load that will read every file asks the kernel to read them (up to READ_AHEAD_MAX) while it
    checks the headers and plans; it stops asking when its reads begin (or the checkpoint closes)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    rows = 3 * READ_AHEAD_WINDOW // 4096  # float32 rows of 1024: three windows a file
    files = [tmp_path / "part-1.safetensors", tmp_path / "part-2.safetensors"]
    save_file({"x": torch.ones(rows, 1024)}, str(files[0]))
    save_file({"y": torch.ones(rows, 1024)}, str(files[1]))

    def drop() -> None:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)  # written pages are dirty: only clean ones can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    drop()
    if _cached_pages(files[1]) > 0.5:
        pytest.skip("this file system keeps the files in memory (tmpfs?): nothing to read ahead")
    plain = Checkpoint(tmp_path)
    assert plain.read_ahead is None and _cached_pages(files[1]) < 0.5  # reading the header reads little more
    plain.close()

    monkeypatch.setattr(checkpoint_module, "READ_AHEAD_MAX", READ_AHEAD_WINDOW)  # one window in all
    bounded = Checkpoint(tmp_path, read_ahead=True)
    wait_until(lambda: not bounded.read_ahead._thread.is_alive(), what="the bounded read-ahead to end")
    wait_until(lambda: _cached_pages(files[0]) > 0.3, what="the first window read")  # of a third of the file
    assert _cached_pages(files[0]) < 0.5 and _cached_pages(files[1]) < 0.5
    bounded.close()
    monkeypatch.undo()

    ahead = Checkpoint(tmp_path, read_ahead=True)
    wait_until(lambda: all(_cached_pages(f) == 1.0 for f in files), what="both files read ahead")
    ahead.close()
    wait_until(lambda: not ahead.read_ahead._thread.is_alive(), what="the read-ahead thread to end")

    drop()
    asked, release, advise = [], threading.Event(), os.posix_fadvise

    def parked(fd, offset, length, advice):  # the thread waits in its first window until released
        asked.append(offset)
        release.wait(10)
        advise(fd, offset, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", parked)
    stopped = Checkpoint(tmp_path, read_ahead=True)
    wait_until(lambda: asked, what="the first window asked for")
    stopped.read_ahead.stop()
    release.set()
    wait_until(lambda: not stopped.read_ahead._thread.is_alive(), what="the read-ahead thread to stop")
    assert asked == [0] and _cached_pages(files[1]) < 0.5
    assert torch.equal(stopped.read("y"), torch.ones(rows, 1024))
    stopped.close()


def test_index_pointing_at_wrong_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file({"x": torch.ones(2)}, str(tmp_path / "part-1.safetensors"))
    save_file({"y": torch.zeros(3)}, str(tmp_path / "part-2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "part-2.safetensors", "y": "part-2.safetensors"}}))
    with pytest.raises(CheckpointError, match="places tensor 'x' in part-2.safetensors"):
        Checkpoint(tmp_path)


def test_index_naming_missing_file(tmp_path):
    make_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        Checkpoint(tmp_path)


GOOD = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize("header, data, header_len, message", [
    (b"", b"", 0, "header is not valid JSON"),
    (GOOD, b"\0" * 8, None, "fall outside the 8-byte data section"),
    (GOOD, b"\0" * 16, 1 << 40, "exceeds the"),
    (GOOD, b"\0" * 16, 5000, "runs past the end"),
    (b"\xff\xfe not json", b"", None, "header is not valid JSON"),
    (b"[1, 2]", b"", None, "not a JSON object"),
    ({"t": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype 'F33'"),
    ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "is 12 bytes but data_offsets span 8"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "fall outside"),
    ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "non-negative integers"),
    ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "needs dtype, shape and data_offsets"),
    ({"t": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype \\['F32'\\]"),
    ({"t": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "non-negative integers"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, True]}}, b"\0" * 8, None, "not a pair of integers"),
    ({"__metadata__": {"format": ["pt"]}}, b"", None, "__metadata__ must be an object of strings"),
    (b"[" * 100_000 + b"]" * 100_000, b"", None, "header is nested too deeply"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlap"),
])
def test_malformed_headers_are_named(tmp_path, header, data, header_len, message):
    """Each way a header can lie gives a CheckpointError that names the file and the problem."""
    path = tmp_path / "model.safetensors"
    write_raw(path, header, data, header_len)
    with pytest.raises(CheckpointError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(path)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        Checkpoint(tmp_path)


def test_identity_changes_when_rewritten_in_place(tmp_path):
    """Same shapes, new values, same header, and the old mtime put back (as `cp -p`, `rsync -t` or
    `touch -r` do): the identity still changes (ctime, which user space cannot set back), and the
    stat-only refresh notices it."""
    make_dir(tmp_path)
    before = Checkpoint(tmp_path).identity
    assert refresh_identity(tuple(before)) == tuple(before)
    file = tmp_path / "model.safetensors"
    old = os.stat(file)
    time.sleep(0.01)
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int8)}, str(tmp_path / "new"))
    with open(file, "r+b") as f:  # as `cp -p new model.safetensors` does: the same inode, rewritten
        f.write((tmp_path / "new").read_bytes())
    os.utime(file, ns=(old.st_atime_ns, old.st_mtime_ns))
    after = refresh_identity(tuple(before))
    assert (after[0].header_sha256, after[0].size, after[0].mtime_ns, after[0].inode) == \
        (before[0].header_sha256, before[0].size, before[0].mtime_ns, before[0].inode)
    assert after[0].differences(before[0]) == ["ctime_ns"]


def test_gc_paused_nests_and_restores_the_collector():
    import gc

    from preload_daemon.buffers import gc_paused
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def _faults_writing(view: memoryview, step: int) -> int:
    """Minor page faults of this process while one byte of every `step` of `view` is written."""
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(0, len(view), step):
        view[i] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_populate_faults_in_a_fresh_buffers_whole_pages_before_it_is_written():
    from preload_daemon import buffers
    page, pages = mmap.PAGESIZE, 256
    fresh, control = (mmap.mmap(-1, pages * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2))
    for mapping in (fresh, control):  # a page a fault, whatever huge pages (of any size) the host hands out
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    view = memoryview(fresh)[100:100 + (pages - 1) * page]  # its first and last pages shared with neighbours
    buffers.populate(view)
    if not buffers._populates:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _faults_writing(memoryview(control), page) >= pages - 8  # what a write into fresh memory costs
    assert _faults_writing(view, page) <= 8  # the two end pages, and whatever the interpreter does
    buffers.populate(memoryview(bytes(4 * page)))  # read-only: nothing, the write (none here) would fault
    buffers.populate(memoryview(bytearray(10))[2:5])  # within a page: nothing
    view.release()
    fresh.close(), control.close()
