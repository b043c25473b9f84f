"""The CUDA slab backend: its pure parts (handle and UUID encoding, finding a slab's GPU in this
process's numbering, error mapping) on any host, a cuda:N daemon refused on a host without a GPU,
and with a GPU (marked `gpu`): a real daemon's slab opened zero-copy in another process."""

import pathlib
import subprocess
import sys

import pytest
import torch

from preload_daemon import cuda
from preload_daemon.errors import DeviceError, InvalidRequestError
from preload_daemon.slab import backend_for, open_slab
from protos import preload_pb2 as pb
from tests.conftest import REPO, run_python

UUIDS = ["GPU-00112233-4455-6677-8899-aabbccddeeff", "GPU-ffeeddcc-bbaa-9988-7766-554433221100"]


def test_uuids_are_written_as_nvidia_smi_writes_them():
    assert cuda.format_uuid(bytes.fromhex("00112233445566778899aabbccddeeff")) == UUIDS[0]
    assert cuda.check_uuid(UUIDS[1]) == UUIDS[1]
    with pytest.raises(ValueError, match="16 bytes"):
        cuda.format_uuid(b"\x00" * 15)
    for bad in ("", "GPU-0011", UUIDS[0].upper(), UUIDS[0] + "0", "MIG-" + UUIDS[0][4:], "../../etc"):
        with pytest.raises(InvalidRequestError, match="not a GPU UUID"):
            cuda.check_uuid(bad)


def test_ipc_handles_are_64_bytes():
    raw = bytes(range(64))
    assert cuda.check_handle(raw) == raw
    for bad in (b"", raw[:63], raw + b"\x00"):
        with pytest.raises(InvalidRequestError, match="64 bytes"):
            cuda.check_handle(bad)


def test_handles_round_trip_through_the_bindings():
    """A manifest's 64 bytes become cuda-python's cudaIpcMemHandle_t and back unchanged (no
    driver needed)."""
    pytest.importorskip("cuda.bindings.runtime")
    raw = bytes(range(100, 164))
    assert cuda.handle_bytes(cuda.handle_from_bytes(raw)) == raw


def test_a_slab_is_found_on_its_gpu_in_this_process_numbering():
    """CUDA_VISIBLE_DEVICES renumbers GPUs per process: the slab's GPU is found by its UUID, and an
    engine that named another ordinal is told which one holds the slab."""
    assert cuda.ordinal_of(UUIDS[1], UUIDS) == 1
    assert cuda.ordinal_of(UUIDS[1], UUIDS, wanted=1) == 1
    with pytest.raises(DeviceError, match="cuda:1 in this process, not cuda:0; give this engine --devices cuda:1"):
        cuda.ordinal_of(UUIDS[1], UUIDS, wanted=0)
    with pytest.raises(DeviceError, match="does not see .*CUDA_VISIBLE_DEVICES"):
        cuda.ordinal_of(UUIDS[1], UUIDS[:1])
    with pytest.raises(DeviceError, match="sees no GPU"):
        cuda.ordinal_of(UUIDS[0], [])


def test_cuda_errors_name_the_call_the_error_and_the_fix():
    message = cuda.error_message("cudaMalloc", "cudaErrorMemoryAllocation", "out of memory")
    assert message.startswith("cudaMalloc failed: cudaErrorMemoryAllocation (out of memory); ")
    assert "preload evict" in message
    assert cuda.error_message("cudaFree", "cudaErrorUnknown", "unknown error") == \
        "cudaFree failed: cudaErrorUnknown (unknown error)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_without_a_gpu_cuda_calls_fail_with_the_reason():
    """The real bindings on a host without a GPU (or without cuda-python): a DeviceError naming what
    is missing and to use cpu:N, never a raw exception or an error code."""
    with pytest.raises(DeviceError, match="cpu:N") as e:
        cuda.call("cudaGetDeviceCount")
    assert "driver" in str(e.value) or "cuda-python" in str(e.value)
    with pytest.raises(DeviceError, match="cpu:N"):
        backend_for("cuda:0", REPO)


def test_a_slab_of_an_unknown_backend_is_refused():
    with pytest.raises(DeviceError, match="backend 'nvme'.*upgrade preload"):
        open_slab(pb.Slab(id="s", backend="nvme", size=256))
    with pytest.raises(InvalidRequestError, match="64 bytes"):
        open_slab(pb.Slab(id="s", backend="cuda", size=256, handle=b"short", device_uuid=UUIDS[0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_cuda_slab_is_refused_where_torch_has_no_cuda():
    """A well-formed CUDA slab (a client of a GPU daemon with a CPU build of torch): refused with the
    reason before any CUDA call, not a raw error from inside torch."""
    slab = pb.Slab(id="s", backend="cuda", size=256, handle=bytes(64), device_uuid=UUIDS[0])
    with pytest.raises(DeviceError, match="torch here has no CUDA"):
        open_slab(slab, "cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_cuda_daemon_on_a_host_without_a_gpu_refuses_to_start(tmp_path):
    """Never host memory in place of device memory: the daemon exits at once with the reason."""
    run = subprocess.run([sys.executable, "-m", "preload_daemon", "--device", "cuda:0", "--runtime-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("preload daemon: ") and "cpu:N" in last, run.stderr
    assert not list((tmp_path / "run").glob("*.sock")), "a socket was left behind"
    shm = pathlib.Path("/dev/shm") / (tmp_path / "run" / "shm-dir").read_text().strip()
    assert not shm.exists(), "its empty shared-memory directory was left behind"


@pytest.mark.gpu
def test_a_cuda_slab_opens_zero_copy_in_another_process(tmp_path):
    """A slab made on cuda:0, sealed and exported, opened by a child process through its IPC handle:
    the child reads the same bytes on the same GPU."""
    slab = backend_for("cuda:0", tmp_path).create("test", 1 << 20)
    slab.data.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    digest = slab.hash()
    slab.seal(digest)
    try:
        assert slab.hash() == digest  # copied back from the device
        exported = slab.export()
        handle, uuid = exported["handle"].hex(), exported["device_uuid"]
        code = ("import torch; from preload_daemon import cuda\n"
                f"data = cuda.open_ipc(bytes.fromhex({handle!r}), {uuid!r}, 1 << 20)\n"
                "print(int(data.to(torch.int64).sum()), data.device)")
        expected = int(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8).to(torch.int64).sum())
        assert run_python(code).split() == [str(expected), "cuda:0"]
    finally:
        slab.close()
