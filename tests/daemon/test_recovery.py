"""Crash recovery in the store: a new store on the device adopts the slabs a previous one left
(versions, variants, pointers, pins, numbering), re-hashing each; anything partial, corrupt or
changed is discarded and reported; another device's slabs are left alone."""

import errno
import os

import pytest

from preload_daemon import adopt
from preload_daemon.errors import DeviceError, LoadingError
from preload_daemon.plan import LoadSpec
from preload_daemon.store import ModelStore
from tests.conftest import copy_checkpoint, me


def snapshot(store: ModelStore) -> list:
    return [(m.name, m.active, m.last, m.keep, [(n, v.pinned, v.source, sorted((str(x.layout), x.key.content_digest)
                                                                           for x in v.variants.values()))
                                              for n, v in sorted(m.versions.items())]) for m in store.models()]


def test_a_new_store_adopts_everything_a_dead_one_left(tmp_path, tiny_llama):
    shm = tmp_path / "shm"
    first = ModelStore("cpu:0", shm)
    first.load(LoadSpec(path=str(tiny_llama), name="m"))
    first.load(LoadSpec(path=str(tiny_llama), name="m", dtype="bfloat16"))
    first.pin("m", 1, True)
    before = snapshot(first)  # `first` is never closed: as if its daemon was killed
    second = ModelStore("cpu:0", shm)
    found = second.adopt()
    assert snapshot(second) == before and found.bytes == sum(v.slab.size for v in first.variants())
    assert [line.split(" (")[0] for line in second.recovery] == ["adopted m v1"] * 2
    variant, lease = second.attach("m", me())
    assert variant.version.number == 1 and lease.pid == os.getpid()
    old = {v.layout: v.slab.data for v in first.variants()}
    assert all(old[v.layout].equal(v.slab.data) for v in second.variants())


def test_partial_corrupt_and_changed_slabs_are_discarded_and_reported(tmp_path, tiny_llama):
    shm = tmp_path / "shm"
    first = ModelStore("cpu:0", shm)
    first.load(LoadSpec(path=str(tiny_llama), name="good"))
    first.load(LoadSpec(path=str(tiny_llama), name="changed"))
    first.load(LoadSpec(path=str(tiny_llama), name="garbled"))
    first.load(LoadSpec(path=str(tiny_llama), name="typed"))
    slabs = {v.name: v.slab.path for v in first.variants()}
    typed = slabs["typed"].with_name(slabs["typed"].name + ".json")
    typed.write_text(typed.read_text().replace('"created_at": ', '"created_at": null, "was": '))
    os.chmod(slabs["changed"], 0o600)
    with open(slabs["changed"], "r+b") as f:  # a same-uid process writes behind the daemon's back
        f.seek(100)
        f.write(b"\xff")
    slabs["garbled"].with_name(slabs["garbled"].name + ".json").write_text("{not json")
    (shm / "cpu0-partial-v1-0123456789ab.slab").write_bytes(b"\0" * 4096)  # a load that never finished
    (shm / "cpu0-lost-v1-0123456789ab.slab.json").write_text("{}")  # a record without its slab
    (shm / "cpu0-dir-v1-0123456789ab.slab.json").mkdir()  # a directory where a record would be: no crash
    (shm / ".state-cpu0.json.123.456.tmp").write_text("{")  # writes a crash cut short
    (shm / ".cpu0-good-v1-0123456789ab.slab.json.123.457.tmp").write_text("{")
    other = shm / "cpu1-m-v1-0123456789ab.slab"  # another device's: not ours to touch
    other.write_bytes(b"\0" * 64)
    second = ModelStore("cpu:0", shm)
    second.adopt()
    assert [m.name for m in second.models() if m.versions] == ["good"]
    # The others' slabs are gone, but not their numbers: a next load of them is v2 (never reused).
    assert [(m.name, m.last) for m in second.models() if not m.versions] == [("changed", 1), ("garbled", 1),
                                                                             ("typed", 1)]
    report = "\n".join(second.recovery)
    assert "adopted good v1" in report
    assert f"discarded {slabs['changed'].name}: its bytes changed after it was sealed" in report
    assert f"discarded {slabs['garbled'].name}: its record is not valid JSON" in report
    assert f"discarded {slabs['typed'].name}: its record does not parse (TypeError" in report
    assert "discarded cpu0-partial-v1-0123456789ab.slab: no record beside it (a load that did not finish)" in report
    assert "discarded cpu0-lost-v1-0123456789ab.slab.json: a record without its slab" in report
    assert not slabs["changed"].exists() and not slabs["garbled"].exists() and other.exists()
    assert not list(shm.glob(".*.tmp"))
    assert sorted(p.name for p in shm.iterdir() if p.name.startswith("cpu0-")) == \
        sorted([slabs["good"].name, slabs["good"].name + ".json", "cpu0-dir-v1-0123456789ab.slab.json"])


def test_pointers_and_numbering_go_on_after_a_crash(tmp_path, tiny_llama):
    shm = tmp_path / "shm"
    first = ModelStore("cpu:0", shm)
    for copy in "abc":
        copy_checkpoint(tiny_llama, tmp_path / copy)
    first.load(LoadSpec(path=str(tmp_path / "a"), name="m"))
    first.load(LoadSpec(path=str(tmp_path / "b"), name="m"))
    first.set_active("m", 1)
    first.pin("m", 2, True)
    second = ModelStore("cpu:0", shm)
    second.adopt()
    [model] = second.models()
    assert (model.active, model.last, sorted(model.versions), model.versions[2].pinned) == (1, 2, [1, 2], True)
    assert second.load(LoadSpec(path=str(tmp_path / "c"), name="m"))[0].version.number == 3


def test_a_load_past_its_timeout_fails_and_keeps_nothing(tmp_path, tiny_llama):
    store = ModelStore("cpu:0", tmp_path / "shm", load_timeout_s=1e-9)
    with pytest.raises(LoadingError, match=r"took longer than 1e-09s \(the daemon's --load-timeout\); nothing of it"):
        store.load(LoadSpec(path=str(tiny_llama), name="m"))
    assert store.variants() == [] and not list((tmp_path / "shm").glob("*.slab"))


def test_a_daemon_that_fails_to_start_leaves_no_socket_or_lock_behind(runtime_dir, monkeypatch):
    """A failure late in start-up (here: gRPC refuses) closes the session listener and its socket
    file and frees the device lock, so that a retry in the same process starts cleanly, and leaves
    no slab directory (it had kept the state file adopt wrote, and so the directory)."""
    from preload_daemon import server
    from preload_daemon.config import DaemonConfig
    from preload_daemon.sessions import session_path

    config = DaemonConfig(device="cpu:0", runtime_dir=runtime_dir)

    def refuse(*args, **kwargs):
        raise RuntimeError("no gRPC today")

    with monkeypatch.context() as patch:
        patch.setattr(server.grpc, "server", refuse)
        with pytest.raises(RuntimeError, match="no gRPC today"):
            server.DaemonServer(config)
    assert not session_path(config.socket_path).exists()
    assert not config.shm_dir.exists()
    server.DaemonServer(config).stop(grace=0)  # the device lock was released


def test_a_load_that_waited_through_an_eviction_fills_the_model_the_store_holds(tmp_path, tiny_llama, monkeypatch):
    """A load looks its model up, then waits for the model's load lock. If the model is evicted
    meanwhile and another load makes a new one of that name, the waiting load must fill the model
    the store holds: it filled a dropped one, whose slab nothing then freed, not even a graceful
    close, and whose record a restarted daemon adopted as a version the user had evicted (two
    clients looping load and evict, found by a hostile probe). A model whose versions have all gone
    keeps its record (its numbers are never given out again: the next load is v2); a model dropped
    (a first load that failed, here made to look dropped) is made anew."""
    shm = tmp_path / "shm"
    store = ModelStore("cpu:0", shm)
    store.load(LoadSpec(path=str(tiny_llama), name="m"))
    stale = store._model("m")  # what a load that is about to queue holds
    store.evict("m", force=True)
    assert store._model("m") is stale and stale.last == 1 and not stale.versions
    store._models.pop("m")  # as if dropped
    store.load(LoadSpec(path=str(tiny_llama), name="m"))  # a new model of that name
    monkeypatch.setattr(store, "_model", lambda name, create=False: stale)
    store.load(LoadSpec(path=str(tiny_llama), name="m", dtype="bfloat16"))
    monkeypatch.undo()
    assert [(n, sorted(str(x.layout) for x in v.variants.values())) for n, v in store._model("m").versions.items()] \
        == [(1, ["bfloat16/none rank 0/1 main", "float32/none rank 0/1 main"])]
    store.close()
    assert sorted(p.name for p in shm.iterdir() if p.name.endswith((".slab", ".slab.json"))) == []
    assert ModelStore("cpu:0", shm).adopt().bytes == 0


def test_verify_passes_over_a_slab_evicted_while_it_ran(tmp_path, tiny_llama, monkeypatch):
    """Verify hashes outside the store's lock: a version evicted meanwhile (retention during a publish,
    an `evict`) has lost its file, which is not corruption (it was reported as such, with an error
    line); one still held and deleted behind the daemon's back is."""
    import preload_daemon.slab as slab_module
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="a"))
    store.load(LoadSpec(path=str(tiny_llama), name="b"))
    real = slab_module.slab_gone

    def evicting(slab):
        if store.models()[0].versions:
            store.evict("a", force=True)  # as another client's evict would, between the listing and the hash
        return real(slab)

    monkeypatch.setattr(slab_module, "slab_gone", evicting)
    assert [(variant.name, actual == variant.slab.digest) for variant, actual in store.verify()] == [("b", True)]
    monkeypatch.undo()
    [held] = [v for v in store.variants() if v.name == "b"]
    held.slab.path.unlink()
    assert [actual for _, actual in store.verify()] == ["gone: file deleted"]
    store.close()


def test_a_slab_truncated_while_verify_hashes_it_is_said_not_a_sigbus(tmp_path, tiny_llama, monkeypatch):
    """Truncated after verify's first look at its file: the hash read past the file's end (SIGBUS).
    It now looks again before each chunk it hashes."""
    import preload_daemon.slab as slab_module
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="a"))
    [variant] = store.variants()
    monkeypatch.setattr(slab_module, "HASH_CHUNK", 4096)
    real = slab_module.slab_gone

    def truncating(slab):  # says the file is whole, then it is cut short
        found = real(slab)
        os.truncate(slab.path, 4096)
        return found

    monkeypatch.setattr(slab_module, "slab_gone", truncating)
    [(_, actual)] = store.verify()
    assert actual == f"gone: file truncated to 4096 bytes from {variant.slab.size}"
    assert variant.version.state == "damaged"
    store.close()


def test_verify_under_a_truncation_loop_reports_and_never_faults(tmp_path, tiny_llama):
    """A truncation between verify's look at the file and its reading of a chunk still faulted the
    daemon (SIGBUS): verify reads the file now, where a truncation is a short read."""
    import threading

    from preload_daemon import slab as slab_module
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="a"))
    [variant] = store.variants()
    size, stop = variant.slab.size, threading.Event()

    def flap() -> None:
        while not stop.is_set():
            os.truncate(variant.slab.path, 4096)
            os.truncate(variant.slab.path, size)

    flapping = threading.Thread(target=flap)
    flapping.start()
    try:
        seen = {slab_module.rehash(variant.slab).split(" from ")[0] for _ in range(200)}
    finally:
        stop.set()
        flapping.join()
    assert all(s.startswith(("gone: file truncated to", "xxh3_128:")) for s in seen), seen
    store.close()


def test_a_load_whose_slab_cannot_be_recorded_fails_and_keeps_nothing(tmp_path, tiny_llama, monkeypatch):
    """/dev/shm full after the slab was made: the load reported success with a warning in the log, and a
    daemon restarted after a crash deleted the slab ("a load that did not finish")."""
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="kept"))

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(adopt, "write_record", full)
    with pytest.raises(DeviceError, match=r"cannot record the slab of m v1 on cpu:0 beside it \(No space left on "
                                          r"device\), .*nothing of this load was kept: free space in"):
        store.load(LoadSpec(path=str(tiny_llama), name="m"))
    assert [v.name for v in store.variants()] == ["kept"]
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "shm").glob("*.slab")) == ["kept"]
    monkeypatch.undo()
    store.load(LoadSpec(path=str(tiny_llama), name="m"))  # once there is room
    again = ModelStore("cpu:0", tmp_path / "shm")  # `store` never closed: as if its daemon was killed
    again.adopt()
    assert sorted(v.name for v in again.variants()) == ["kept", "m"]


def test_a_rollback_or_pin_that_cannot_be_saved_is_undone_and_says_so(tmp_path, tiny_llama, monkeypatch):
    """/dev/shm full (any user can fill it): a rollback and a pin reported success while only the
    daemon's memory had them, and a daemon restarted after a crash activated the newest version,
    unpinned. Now each is undone, and the caller told why."""
    store = ModelStore("cpu:0", tmp_path / "shm")
    store.load(LoadSpec(path=str(tiny_llama), name="m"))
    store.load(LoadSpec(path=str(tiny_llama), name="m", dtype="bfloat16"))
    copy = tmp_path / "copy"
    copy_checkpoint(tiny_llama, copy)
    store.load(LoadSpec(path=str(copy), name="m"))
    assert [v.number for v in next(m for m in store.models() if m.name == "m").versions.values()] == [1, 2]

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(adopt, "write_state", full)
    with pytest.raises(DeviceError, match=r"No space left on device\), which a daemon restarted after a crash reads; "
                                          r"m's active version stays v2: free space there"):
        store.set_active("m", 1)
    with pytest.raises(DeviceError, match="m v1 stays as it was"):
        store.pin("m", 1, True)
    model = next(m for m in store.models() if m.name == "m")
    assert model.active == 2 and not model.versions[1].pinned
    monkeypatch.undo()
    store.set_active("m", 1)
    store.pin("m", 1, True)
    again = ModelStore("cpu:0", tmp_path / "shm")  # `store` never closed: as if its daemon was killed
    again.adopt()
    model = next(m for m in again.models() if m.name == "m")
    assert model.active == 1 and model.versions[1].pinned
