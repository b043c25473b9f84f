"""The lease keeper's answer to a daemon that died: serve on from host memory (degraded), but never
from device memory that died with the daemon."""

import pathlib

from preload_daemon.attached import AttachedModel
from protos import preload_pb2 as pb
from tests.conftest import wait_until
from worker.loader import LeaseKeeper, LoadedWeights
from worker.state import WorkerState


class DaemonGone:
    """What the keeper watches of an attachment, whose daemon has just died (its session closed)."""

    version, layout = 1, "bfloat16/none rank 0/1 main"
    in_device_memory = AttachedModel.in_device_memory  # the real test, over this manifest

    def __init__(self, backend: str):
        self.manifest = pb.Manifest(model="m", version=1, slabs=[pb.Slab(id="s", backend=backend, size=256)])

    def wait_lost(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


def engine_state(backend: str, runtime_dir: pathlib.Path) -> WorkerState:
    state = WorkerState("m", "ipc_cache")
    weights = LoadedWeights(tensors={}, config={}, load_format="ipc_cache", attached=DaemonGone(backend))
    state.keepers = [LeaseKeeper(weights, "cuda:0" if backend == "cuda" else "cpu:0", runtime_dir, 0.01).start()]
    state._ready.set()
    wait_until(lambda: state.keepers[0].lost, what="the keeper to notice")
    return state


def test_a_lost_cuda_slab_ends_readiness(runtime_dir):
    state = engine_state("cuda", runtime_dir)
    try:
        assert state.keepers[0].fatal and not state.is_ready()
        body = state.readiness()
        assert body["status"] == "failed" and "died with it; restart this engine" in body["reason"], body
    finally:
        state.keepers[0].stop(join=True)


def test_a_lost_host_slab_keeps_serving_degraded(runtime_dir):
    state = engine_state("host", runtime_dir)
    try:
        assert not state.keepers[0].fatal and state.is_ready()
        assert "serving from the mapped slab" in state.degraded()
    finally:
        state.keepers[0].stop(join=True)
