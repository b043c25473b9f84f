"""Versions in a real daemon: publish beside attached versions, pin, roll back, retention and the
byte budget, failed publishes that leave nothing behind, and trainer-streamed versions that equal
directory-loaded ones bit for bit."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from preload_daemon.adopt import state_path
from preload_daemon.checkpoint import stat_identity
from preload_daemon.errors import (BudgetError, CheckpointError, InvalidRequestError, LeasedError, LoadingError,
                                   NotFoundError)
from preload_daemon.plan import Layout, LoadSpec
from preload_daemon.versions import Target, publish_dir, publish_tensors, rollback
from tests.conftest import REPO, copy_checkpoint


def variant_of(tiny_llama, tmp_path, name: str, shift: float) -> tuple[pathlib.Path, dict]:
    """A copy of the tiny checkpoint with every weight moved by `shift`: other weights, same shapes."""
    path = tmp_path / name
    tensors = copy_checkpoint(tiny_llama, path)
    tensors = {k: v + shift for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path, tensors


def slabs(daemon) -> set[str]:
    return {p.name for p in daemon.config.shm_dir.glob("*.slab")} if daemon.config.shm_dir.exists() else set()


def publish(daemon, name: str, path, **kwargs):
    return publish_dir(name, str(path), [Target(daemon.config.device, [Layout()])], daemon.config.runtime_dir,
                       show_progress=False, **kwargs)


def attached_version(daemon, name: str = "m", **kwargs) -> int:
    """The version an attach gets (the lease is given back at once)."""
    model = daemon.client.attach(name, **kwargs)
    model.release()
    return model.version


def versions(daemon, name: str = "m") -> dict[int, tuple[bool, bool]]:
    """{version: (active, pinned)}"""
    [summary] = [s for s in daemon.client.summaries() if s.name == name]
    return {v.version: (v.active, v.pinned) for v in summary.versions}


def test_publish_beside_an_attached_version_then_free_it_when_its_lease_ends(daemon, tiny_llama, tmp_path):
    one, w1 = variant_of(tiny_llama, tmp_path, "one", 0.0)
    two, w2 = variant_of(tiny_llama, tmp_path, "two", 0.5)
    daemon.client.load(LoadSpec(path=str(one), name="m"))
    attached = daemon.client.attach("m", files=stat_identity(one))
    assert attached.version == 1
    published = publish(daemon, "m", two, keep=0)
    assert (published.version, published.created) == (2, True)
    assert versions(daemon) == {1: (False, False), 2: (True, False)}, "v1 is leased: retention keeps it"
    # The attached worker keeps reading version 1's bytes after the pointer moved.
    assert torch.equal(attached["model.norm.weight"], w1["model.norm.weight"])
    now = daemon.client.attach("m")  # the active version
    assert now.version == 2 and torch.equal(now["model.norm.weight"], w2["model.norm.weight"])
    assert daemon.client.attach("m", files=stat_identity(one)).version == 1, "an engine on v1's files gets v1"
    assert len(slabs(daemon)) == 2
    for lease in [x.id for m in daemon.client.list_models() if m.version == 1 for x in m.leases]:
        daemon.client.release(lease)
    assert versions(daemon) == {2: (True, False)}, "out of retention and unleased: freed at the last release"
    assert len(slabs(daemon)) == 1
    assert torch.equal(attached["model.norm.weight"], w1["model.norm.weight"]), "mapped pages outlive the file"
    with pytest.raises(NotFoundError, match="has no version 1 on cpu:0 \\(it was freed\\)"):
        daemon.client.attach("m", version=1)


def test_a_number_is_never_given_out_again_after_every_version_is_evicted(start_daemon, tiny_llama, tmp_path):
    """Evicting every version of a model keeps its record of the numbers given out: the next publish
    is v3, not v1 again under other weights (an engine still serving the old v1 would report the same
    number as one on the new); the record outlives a daemon killed and started again (its state file)."""
    daemon = start_daemon()
    one, _ = variant_of(tiny_llama, tmp_path, "one", 0.0)
    two, _ = variant_of(tiny_llama, tmp_path, "two", 0.5)
    assert [publish(daemon, "m", path).version for path in (one, two)] == [1, 2]
    daemon.client.evict("m", force=True)
    assert versions(daemon) == {} and not slabs(daemon)
    assert publish(daemon, "m", two).version == 3
    daemon.client.evict("m", force=True)
    daemon.proc.kill()  # SIGKILL: no graceful close
    daemon.proc.wait()
    again = start_daemon()
    assert [s.last_version for s in again.client.summaries() if s.name == "m"] == [3]
    assert publish(again, "m", one).version == 4
    with pytest.raises(InvalidRequestError, match="never reused"):
        again.client.load(LoadSpec(path=str(two), name="m"), version=2)


def test_a_state_file_record_out_of_range_is_ignored_alone(start_daemon, tiny_llama, tmp_path):
    """A state file whose numbers the daemon itself would never write (a keep of -1, a last past
    2**31) was adopted as it was, and every GetStats failed after: status found the daemon
    unreachable, and serve stopped it, freeing every adopted slab. Such a record is ignored, alone."""
    daemon = start_daemon()
    one, _ = variant_of(tiny_llama, tmp_path, "one", 0.0)
    two, _ = variant_of(tiny_llama, tmp_path, "two", 0.5)
    for name in ("m", "n"):
        assert [publish(daemon, name, path).version for path in (one, two)] == [1, 2]
        daemon.client.set_active(name, 1)
    daemon.proc.kill()
    daemon.proc.wait()
    path = state_path(daemon.config.shm_dir, "cpu:0")
    state = json.loads(path.read_text())
    for record in state["models"]:
        if record["name"] == "n":
            record["keep"] = -1
    path.write_text(json.dumps(state))
    again = start_daemon()
    stats = again.client.stats()
    assert any("ignored 'n' in" in line and "keep -1 is not an integer in [0, " in line for line in stats.recovery)
    assert {s.name: s.active_version for s in again.client.summaries()} == {"m": 1, "n": 2}


def test_serving_the_same_files_with_another_tp_size_keeps_their_version_on_every_rank(start_daemon, tiny_llama):
    """A daemon holding the files as v1 answers v1 to a load of them whatever number it is asked, and a
    new daemon took the next number: serving again with --tp-size 2 failed ("different versions of
    m"), with advice that failed again. Every rank now loads them as the version that holds them."""
    a = start_daemon("cpu:0")
    assert publish(a, "m", tiny_llama).version == 1
    b = start_daemon("cpu:1")
    targets = [Target("cpu:0", [Layout(tp_size=2)]), Target("cpu:1", [Layout(tp_size=2, tp_rank=1)])]
    published = publish_dir("m", str(tiny_llama), targets, a.config.runtime_dir, show_progress=False)
    assert published.version == 1
    for d, rank in ((a, 0), (b, 1)):
        assert versions(d) == {1: (True, False)}
        assert attached_version(d, layout=Layout(tp_size=2, tp_rank=rank)) == 1


def test_pin_rollback_and_keep(daemon, tiny_llama, tmp_path):
    paths = [variant_of(tiny_llama, tmp_path, f"s{i}", i / 10)[0] for i in range(4)]
    daemon.client.load(LoadSpec(path=str(paths[0]), name="m"))
    daemon.client.pin("m", 1)
    for path in paths[1:3]:
        publish(daemon, "m", path, keep=0)
    assert versions(daemon) == {1: (False, True), 3: (True, False)}, "pinned v1 stays, v2 goes at once (keep 0)"
    with pytest.raises(LeasedError, match="pinned"):
        daemon.client.evict("m", 1)
    rollback("m", 1, daemon.config.runtime_dir)
    assert attached_version(daemon) == 1
    assert versions(daemon) == {1: (True, True)}, "keep 0: the version rolled back from goes too"
    with pytest.raises(NotFoundError, match="v3 is not held by cpu:0 \\(has v1\\)"):
        rollback("m", 3, daemon.config.runtime_dir)
    publish(daemon, "m", paths[3], keep=1)
    assert versions(daemon) == {1: (False, True), 4: (True, False)}
    daemon.client.pin("m", 1, pinned=False)
    assert versions(daemon) == {1: (False, False), 4: (True, False)}, "unpinned: the newest 1 inactive one stays"
    publish(daemon, "m", paths[2])
    assert versions(daemon) == {4: (False, False), 5: (True, False)}, "v3's files come back as v5; v1 falls out"
    again = publish(daemon, "m", paths[3])  # v4's files again: no new version, made active
    assert (again.version, again.created) == (4, False) and versions(daemon) == {4: (True, False), 5: (False, False)}


def test_budget_frees_the_oldest_or_refuses(daemon, tiny_llama, tmp_path):
    paths = [variant_of(tiny_llama, tmp_path, f"b{i}", i / 10)[0] for i in range(4)]
    info = daemon.client.load(LoadSpec(path=str(paths[0]), name="m"), keep=5, max_bytes=0)
    size = info.slab_bytes
    publish(daemon, "m", paths[1], max_bytes=int(2.5 * size))
    publish(daemon, "m", paths[2])
    assert sorted(versions(daemon)) == [2, 3], "the budget freed the oldest version"
    daemon.client.pin("m", 2)
    before = slabs(daemon)
    with pytest.raises(BudgetError, match=r"v2 \(pinned, .*v3 \(active,.*raise --max-bytes"):
        publish(daemon, "m", paths[3])
    assert slabs(daemon) == before and sorted(versions(daemon)) == [2, 3] and versions(daemon)[3][0]
    assert attached_version(daemon) == 3, "the active version kept serving"


def test_failed_publishes_leave_the_active_version_and_no_slab(start_daemon, tiny_llama, tmp_path):
    """A bad file, and a TP publish whose second rank fails half-way: nothing new stays anywhere."""
    a, b = start_daemon("cpu:0"), start_daemon("cpu:1")
    good, _ = variant_of(tiny_llama, tmp_path, "good", 0.0)
    for rank, d in enumerate((a, b)):
        d.client.load(LoadSpec(path=str(good), name="m", tp_size=2, tp_rank=rank), max_bytes=0)
    bad = tmp_path / "bad"
    copy_checkpoint(tiny_llama, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(bad / "model.safetensors") - 100)
    runtime = a.config.runtime_dir
    before = {d: slabs(d) for d in (a, b)}
    with pytest.raises(CheckpointError, match="truncated"):
        publish_dir("m", str(bad), [Target("cpu:0", [Layout(tp_size=2)]), Target("cpu:1", [Layout(tp_size=2, tp_rank=1)])],
                    runtime, show_progress=False)
    # Rank 1's daemon has no room for another version: rank 0 loads it, then it is freed there too.
    b.client.load(LoadSpec(path=str(good), name="m", tp_size=2, tp_rank=1), max_bytes=1)
    newer, _ = variant_of(tiny_llama, tmp_path, "newer", 0.25)
    from preload_daemon.versions import targets_for
    with pytest.raises(BudgetError, match=r"cpu:1: .*whole budget.*\(v3 was freed on cpu:0; this publish left the "
                                          "active version of m as it was"):
        publish_dir("m", str(newer), targets_for("m", runtime), runtime, show_progress=False)
    for d in (a, b):
        assert slabs(d) == before[d], "a slab of the failed publish stayed behind"
        assert versions(d) == {1: (True, False)}
        assert attached_version(d, layout=Layout(tp_size=2, tp_rank=int(d is b))) == 1
    failures = [f for s in a.client.summaries() for f in s.failures]
    assert any("truncated" in f for f in failures)


def test_trainer_stream_equals_the_directory_load_bit_for_bit(daemon, tiny_llama):
    import transformers
    trainer = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    layouts = (Layout(), Layout(quantization="int8"))
    [plain, int8] = daemon.client.load_all(LoadSpec(path=str(tiny_llama), name="m"), layouts=layouts[1:])
    streamed = daemon.client.publish("m", trainer.state_dict(), trainer.config.to_dict(), layouts=layouts,
                                     label="step 0", chunk_bytes=1000)  # many chunks per tensor
    assert [v.version for v in streamed] == [2, 2] and streamed[0].path == "stream:step 0"
    assert [v.key.content_digest for v in streamed] == [plain.key.content_digest, int8.key.content_digest]
    assert [v.slab_bytes for v in streamed] == [plain.slab_bytes, int8.slab_bytes]
    # By default a streamed version gets the active version's variants.
    again = daemon.client.publish("m", trainer.state_dict(), trainer.config.to_dict())
    assert [v.key.quantization for v in again] == ["none", "int8"] and again[0].version == 3
    assert daemon.client.attach("m").version == 3


def test_bad_streams_are_refused_and_a_killed_publisher_leaves_nothing(daemon, tiny_llama, tmp_path):
    import transformers
    trainer = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    daemon.client.load(LoadSpec(path=str(tiny_llama), name="m"))
    state, config = trainer.state_dict(), trainer.config.to_dict()
    before = slabs(daemon)
    with pytest.raises(CheckpointError, match="missing"):  # a state dict without a layer
        daemon.client.publish("m", {k: v for k, v in state.items() if ".1." not in k}, config)
    with pytest.raises(CheckpointError, match="no kind"):
        daemon.client.publish("m", {**state, "extra.weight": torch.zeros(2)}, config)
    with pytest.raises(CheckpointError, match="config.json"):
        daemon.client.publish("m", state, {**config, "hidden_size": "wide"})
    with pytest.raises(InvalidRequestError, match="v1 was used before"):
        daemon.client.publish("m", state, config, version=1)
    # A trainer killed in the middle of its stream.
    script = tmp_path / "publisher.py"
    script.write_text(
        "import sys, time, transformers\n"
        "from preload_daemon.client import DaemonClient\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2])\n"
        "def slow(sent, total):\n"
        "    print(sent, flush=True)\n"
        "    time.sleep(0.05)\n"
        "DaemonClient(sys.argv[1]).publish('m', m.state_dict(), m.config.to_dict(), chunk_bytes=4096, on_progress=slow)\n")
    proc = subprocess.Popen([sys.executable, str(script), str(daemon.config.socket_path), str(tiny_llama)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    for _ in range(5):
        assert proc.stdout.readline(), "the publisher did not start streaming"
    assert any(s.versions and s.versions[-1].state == "loading" for s in daemon.client.summaries())
    with pytest.raises(LoadingError, match="being loaded or published"):  # a second publisher does not queue
        daemon.client.publish("m", state, config)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(v.version != 1 for s in daemon.client.summaries() for v in s.versions):
        assert time.monotonic() < deadline, "the killed publisher's version stayed"
        time.sleep(0.1)
    assert slabs(daemon) == before and versions(daemon) == {1: (True, False)}
    assert attached_version(daemon) == 1
    assert "the publishing client went away" in daemon.output() or "the stream ended after" in daemon.output()


def test_publish_tensors_to_every_tp_rank(start_daemon, tiny_llama):
    import transformers
    a, b = start_daemon("cpu:0"), start_daemon("cpu:1")
    for rank, d in enumerate((a, b)):
        d.client.load(LoadSpec(path=str(tiny_llama), name="m", tp_size=2, tp_rank=rank))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    version = publish_tensors("m", trainer.state_dict(), trainer.config.to_dict(), runtime_dir=a.config.runtime_dir)
    assert version == 2
    for rank, d in enumerate((a, b)):
        [v1, v2] = sorted(d.client.list_models(), key=lambda m: m.version)
        assert (v2.active, v2.key.tp_rank, v2.key.tp_size) == (True, rank, 2)
        assert v2.key.content_digest == v1.key.content_digest


def test_publish_edge_cases(daemon, tiny_llama, tmp_path):
    """What a careless trainer or operator does: huge version numbers, duplicate layouts, budgets
    too small for one version, and publishing in a loop with the default retention."""
    import transformers
    trainer = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    state, config = trainer.state_dict(), trainer.config.to_dict()
    with pytest.raises(NotFoundError, match=r"holds 'm'; publish a first version of it with devices=\['cpu:0'\]"):
        publish_tensors("m", state, config, runtime_dir=daemon.config.runtime_dir)  # (it named `preload serve DIR`)
    info = daemon.client.load(LoadSpec(path=str(tiny_llama), name="m"))
    with pytest.raises(InvalidRequestError, match="out of range"):
        daemon.client.publish("m", state, config, version=2**31)
    for chunk in (100 << 20, 0):  # gRPC's own "Sent message larger than max", which named neither
        with pytest.raises(InvalidRequestError, match=f"chunk_bytes={chunk} must be between 1 and 32 MiB"):
            daemon.client.publish("m", state, config, chunk_bytes=chunk)
    with pytest.raises(InvalidRequestError, match=r"the publish header \(the names, dtypes and shapes of 2 tensors"):
        daemon.client.publish("m", {"x" * (40 << 20): torch.zeros(1), "y" * (30 << 20): torch.zeros(1)}, config)
    twice = daemon.client.publish("m", state, config, layouts=(Layout(), Layout(dtype="float32")))
    assert len(twice) == 1, "one variant for one resolved layout"
    assert len(slabs(daemon)) == 2
    for _ in range(3):  # activate=True publishes: the default keep (2) applies as with SetActive
        daemon.client.publish("m", state, config)
    assert sorted(versions(daemon)) == [3, 4, 5] and len(slabs(daemon)) == 3
    with pytest.raises(BudgetError, match="more than its whole budget"):
        daemon.client.publish("m", state, config, version=6, max_bytes=info.slab_bytes // 2)
    daemon.client.publish("m", state, config)  # the failed publish's budget did not stay
    failures = daemon.client.summaries()[0].failures
    assert failures[0].startswith("6: BudgetError") and 6 not in versions(daemon), "a failed number is not reused"
    assert max(versions(daemon)) == 7
