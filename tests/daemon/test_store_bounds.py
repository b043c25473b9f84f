"""The store's records under hostile or racing callers: a version still being made is neither
activated nor attached, so a load that fails after its first variant leaves no pointer or lease on
what it frees; leases per session, layouts per request and records of names without versions are
bounded; two publishes that pick one number do not fail each other."""

import time

import pytest
import torch
from safetensors.torch import save_file

from preload_daemon import leasing, loading, versions
from preload_daemon.errors import CheckpointError, InvalidRequestError, LoadingError, NotFoundError, VersionTakenError
from preload_daemon.plan import Layout, LoadSpec
from preload_daemon.records import Retention
from preload_daemon.store import ModelStore
from tests.conftest import copy_checkpoint, me


def test_a_version_is_not_activated_or_attached_until_its_load_ends(tmp_path, tiny_llama):
    """Its bf16 variant was attachable and activatable while the int8 one loaded; when int8 failed
    (a NaN weight), the version was freed with the pointer and a lease still on it: every engine
    following "active" got "still loading" for good, and the failure read "-"."""
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="m"))
    bad = tmp_path / "nan"
    tensors = copy_checkpoint(tiny_llama, bad)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"))
    seen = []

    def meanwhile(progress) -> None:
        [model] = store.models()
        new = model.versions.get(2)
        if new is None or not new.variants or seen:
            return
        seen.append(new.state)
        for call in (lambda: store.set_active("m", 2), lambda: store.attach("m", me(), version=2)):
            with pytest.raises(LoadingError, match="m v2 is still loading on cpu:0"):
                call()

    with pytest.raises(CheckpointError):
        store.load(LoadSpec(path=str(bad), name="m", dtype="bfloat16"),
                   (Layout(dtype="bfloat16", quantization="int8"),), activate=False, on_progress=meanwhile)
    assert seen == ["loading"]  # the bf16 variant was made (and shown) before int8 failed
    [model] = store.models()
    assert model.active == 1 and sorted(model.versions) == [1] and store.leases._variants == {}
    assert model.failures[0].startswith("2: CheckpointError")  # under the number it used up
    variant, _ = store.attach("m", me())
    assert variant.version.number == 1


def test_leases_per_session_are_bounded_and_each_process_is_looked_up_once(tmp_path, tiny_llama, monkeypatch):
    """One session took 50,000 leases; the reaper then asked psutil about each every second."""
    monkeypatch.setattr(leasing, "MAX_LEASES_PER_SESSION", 3)
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="m"))
    leases = [store.attach("m", me())[1] for _ in range(3)]
    with pytest.raises(InvalidRequestError, match="holds 3 leases on this daemon, the most one session may"):
        store.attach("m", me())
    store.leases.release(leases.pop().id)
    leases.append(store.attach("m", me())[1])
    looked_up = []
    monkeypatch.setattr(leasing, "holder_alive", lambda *holder: looked_up.append(holder) or True)
    assert store.leases.reap() == [] and len(looked_up) == 1
    store.evict("m", force=True)  # evicted leases leave the count too
    store.load(LoadSpec(path=str(tiny_llama), name="m"))
    assert len([store.attach("m", me()) for _ in range(3)]) == 3


def test_records_of_names_without_versions_are_bounded(tmp_path, tiny_llama, monkeypatch):
    """Each failed load under a new name left a record for good: 11,000 of them made ListModels 6 MB."""
    monkeypatch.setattr(loading, "MAX_IDLE_RECORDS", 3)
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="kept"))
    store.load(LoadSpec(path=str(tiny_llama), name="evicted"))
    store.evict("evicted")  # its record gave out v1: it stays, so that v1 is never given out again
    for i in range(6):
        with pytest.raises(CheckpointError):
            store.load(LoadSpec(path=str(tmp_path / "nowhere"), name=f"bad{i}"), version=5 if i == 1 else 0)
    assert [m.name for m in store.models()] == ["bad3", "bad4", "bad5", "evicted", "kept"]
    assert store.load(LoadSpec(path=str(tiny_llama), name="evicted"))[0].version.number == 2


def test_a_version_made_without_activating_it_runs_retention(tmp_path, tiny_llama):
    """Retention ran only when a load activated: inactive publishes piled up past --keep."""
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="m"), retention=Retention(keep=1))
    for shift in (1, 2, 3):
        other = tmp_path / f"w{shift}"
        tensors = copy_checkpoint(tiny_llama, other)
        save_file({k: v + shift for k, v in tensors.items()}, str(other / "model.safetensors"))
        store.load(LoadSpec(path=str(other), name="m"), activate=False)
    [model] = store.models()
    assert model.active == 1 and sorted(model.versions) == [1, 3, 4]  # v4 is kept for its publish to activate


def test_too_many_layouts_in_one_request_are_refused(daemon, tiny_llama):
    """100,000 empty layouts cost 24 s of a core and 400 MiB before anything was read."""
    layouts = tuple(Layout(tp_size=65, tp_rank=r) for r in range(65))
    with pytest.raises(InvalidRequestError, match="65 layouts in one request; at most 64"):
        daemon.client.load(LoadSpec(path=str(tiny_llama), name="m"), layouts=layouts)
    assert daemon.client.load(LoadSpec(path=str(tiny_llama), name="m"), layouts=(Layout(),) * 64).version == 1


def test_publish_headers_are_read_only_by_calls_that_hold_a_load_slot(daemon):
    """A header (up to 64 MiB) was read and parsed before the call took one of the daemon's load slots:
    8 publishes of 58 MiB headers at once took the daemon to 1.4 GB, and 256 could have taken 30 GB.
    A call past the slots is now refused before its header is read."""
    import threading

    import grpc

    from preload_daemon.server import MAX_LOADS
    from protos import preload_pb2 as pb
    release = threading.Event()

    def held():  # a publish that has not sent its header yet
        release.wait(30)
        yield from ()

    calls = [daemon.client._stub.PublishStream.future(held(), timeout=60) for _ in range(MAX_LOADS)]
    try:
        deadline = time.monotonic() + 20
        while True:  # once the held calls have their slots, a call's bad header is not even read
            with pytest.raises(grpc.RpcError) as err:
                daemon.client._stub.PublishStream(iter([pb.PublishChunk()]), timeout=30)
            if f"{MAX_LOADS} loads and publishes are in flight" in err.value.details():
                break
            assert "must start with a header" in err.value.details() and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        release.set()
    for call in calls:  # each ends with its own error, and gives its slot back
        with pytest.raises(grpc.RpcError, match="must start with a header"):
            call.result()
    with pytest.raises(grpc.RpcError, match="must start with a header"):
        daemon.client._stub.PublishStream(iter([pb.PublishChunk()]), timeout=30)


def test_a_publish_that_picked_a_taken_number_takes_the_next(daemon, tiny_llama, tmp_path, monkeypatch):
    """Two publishes of one model at once picked one number: the second failed, recorded a failure
    under the first one's healthy version and said the pointer had not moved (it had)."""
    daemon.client.load(LoadSpec(path=str(tiny_llama), name="m"))
    other = tmp_path / "other"
    tensors = copy_checkpoint(tiny_llama, other)
    save_file({k: v + 1 for k, v in tensors.items()}, str(other / "model.safetensors"))
    real, picked = versions._next_number, []

    def stale(name, found):  # as if another publish took the number between our read and our load
        picked.append(real(name, found) - (0 if picked else 1))
        return picked[-1]

    monkeypatch.setattr(versions, "_next_number", stale)
    published = versions.publish_dir("m", str(other), [versions.Target("cpu:0", [Layout()])],
                                     daemon.config.runtime_dir, show_progress=False)
    assert picked == [1, 2] and published.version == 2 and published.created
    [summary] = daemon.client.summaries()
    assert summary.active_version == 2 and list(summary.failures) == []
    with pytest.raises(NotFoundError):
        daemon.client.attach("m", version=3)
    assert torch.equal(daemon.client.attach("m").tensors["model.norm.weight"], tensors["model.norm.weight"] + 1)


def test_files_held_as_a_number_another_daemon_gave_other_weights_are_not_retried(start_daemon, tiny_llama,
                                                                                   tmp_path):
    """Each retry picked the same number again (the one the files are held as) and loaded the files
    in full before failing again, five times, blaming other publishes."""
    a, b = start_daemon("cpu:0"), start_daemon("cpu:1")
    a.client.load(LoadSpec(path=str(tiny_llama), name="m"))
    other = tmp_path / "other"
    tensors = copy_checkpoint(tiny_llama, other)
    save_file({k: v + 1 for k, v in tensors.items()}, str(other / "model.safetensors"))
    b.client.load(LoadSpec(path=str(other), name="m"))
    targets = [versions.Target("cpu:0", [Layout()]), versions.Target("cpu:1", [Layout()])]
    with pytest.raises(InvalidRequestError, match=r"\(on cpu:0 these files are v1\): evict the odd version") as err:
        versions.publish_dir("m", str(tiny_llama), targets, a.config.runtime_dir, show_progress=False)
    assert not isinstance(err.value, VersionTakenError)


def test_a_publish_that_trickles_or_stalls_is_dropped():
    """A stream was dropped only when it sent nothing for the stall limit: a byte every few seconds
    held the model's load lock and a whole slab for the hour of --load-timeout; a header never sent
    held a load slot."""
    from preload_daemon import wire
    from protos import preload_pb2 as pb

    def stream(gap_s: float, nbytes: int, count: int):
        for index in range(count):
            time.sleep(gap_s)
            yield pb.PublishChunk(data=pb.TensorData(index=0, offset=index * nbytes, data=bytes(nbytes)))

    with pytest.raises(InvalidRequestError, match=r"only \d+ bytes of tensor data in the last 0.3s \(at least 1 MiB"):
        list(wire.chunks(stream(0.05, 1, 40), None, 0.3))
    with pytest.raises(InvalidRequestError, match=r"no tensor data for 0.3s after 0 chunk\(s\)"):
        list(wire.chunks(stream(0.5, 1, 2), None, 0.3))
    assert len(list(wire.chunks(stream(0.02, 1 << 20, 30), None, 0.3))) == 30  # 1 MiB every 20 ms: kept
    # and its header: a call that takes a load slot and sends nothing held the slot for good
    with pytest.raises(InvalidRequestError, match=r"no publish header for 0.3s; the publish was dropped"):
        wire.first_chunk(stream(1.0, 1, 1), 0.3)
    assert wire.first_chunk(stream(0.0, 1, 1), 0.3).data.data == b"\0"
