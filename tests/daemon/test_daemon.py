"""The daemon as a real process on a real socket, used from other real processes."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file, save_file

from preload_cli.models import synthetic_checkpoint
from preload_daemon.checkpoint import stat_identity
from preload_daemon.errors import CheckpointError, InvalidRequestError, LeasedError, NotFoundError, StaleError
from preload_daemon.plan import Layout, LoadSpec
from preload_daemon.sessions import session_path
from tests.conftest import REPO, copy_checkpoint, run_preload, wait_until


class Probe:
    """tests/daemon/attach_probe.py in its own process."""

    def __init__(self, socket_path, model, *flags):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.daemon.attach_probe", str(socket_path), model,
                                      *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.report = json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def test_attach_from_another_process_is_bitwise_and_zero_copy(daemon, tiny_llama):
    info = daemon.client.load(LoadSpec(path=str(tiny_llama)))
    assert (info.name, info.version, info.state) == ("tiny-llama", 1, "ready")
    probe = Probe(daemon.config.socket_path, "tiny-llama", "--compare", str(tiny_llama), "--exit")
    probe.close()
    assert probe.report["equal"] and probe.report["shares_storage"]
    assert probe.report["num_tensors"] == len(load_file(str(tiny_llama / "model.safetensors")))


def test_slab_is_private_read_only_and_unique(start_daemon, tiny_llama):
    """Slab files are 0400 in a 0700 directory; two daemons on two devices hold two distinct slabs."""
    a, b = start_daemon("cpu:0"), start_daemon("cpu:1")
    for d in (a, b):
        d.client.load(LoadSpec(path=str(tiny_llama)))
    slabs = {d.config.device: d.client.attach("tiny-llama").manifest.slabs[0].path for d in (a, b)}
    assert len(set(slabs.values())) == 2
    for path in map(pathlib.Path, slabs.values()):
        assert path.stat().st_mode & 0o777 == 0o400
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert str(path).startswith("/dev/shm/")
    a.client.evict("tiny-llama", force=True)
    assert not pathlib.Path(slabs["cpu:0"]).exists() and pathlib.Path(slabs["cpu:1"]).exists()
    assert b.client.attach("tiny-llama").version == 1


def test_second_attaching_process_adds_almost_no_memory(daemon, tmp_path):
    """Two processes that read every byte of a 200 MB slab each keep under 10% of it private (USS);
    PSS splits the pages between the daemon and both workers."""
    ckpt = synthetic_checkpoint(tmp_path / "synth", 0.2, hidden=512)
    info = daemon.client.load(LoadSpec(path=str(ckpt)))
    first = Probe(daemon.config.socket_path, "synth", "--touch")
    second = Probe(daemon.config.socket_path, "synth", "--touch")
    try:
        for probe in (first, second):
            r = probe.report
            assert r["rss"] - r["uss"] > 0.9 * info.slab_bytes, "the probe did not map and read the slab"
            assert r["uss"] - r["uss_before"] < 0.1 * info.slab_bytes, r
        assert second.report["pss"] < second.report["uss"] + 0.5 * info.slab_bytes
    finally:
        first.close()
        second.close()


def test_killed_worker_lease_is_reaped_then_evict_works(daemon, tiny_llama):
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    probe = Probe(daemon.config.socket_path, "tiny-llama")
    models = daemon.client.list_models()
    assert [lease.pid for lease in models[0].leases] == [probe.report["pid"]]
    with pytest.raises(LeasedError, match=f"leased by pid {probe.report['pid']}"):
        daemon.client.evict("tiny-llama")
    probe.proc.kill()
    probe.proc.wait()
    wait_until(lambda: not daemon.client.list_models()[0].leases, timeout=10, what="lease reaping")
    # Its session's close ends it at once; the reaper (every second, by pid) is the second line, and
    # on a loaded machine it can be first (CI saw the session's close logged 3 s after the reap).
    out = daemon.output()
    assert "ended with its session" in out or "reaped: its process is gone" in out
    with pytest.raises(NotFoundError):
        daemon.client.renew(probe.report["lease"])
    assert [m.version for m in daemon.client.evict("tiny-llama")] == [1]
    assert daemon.client.list_models() == []


def test_a_lease_is_renewed_and_released_only_by_the_session_that_took_it(daemon, tiny_llama):
    """Lease ids are public (ListModels, `status --json`): another process releasing an engine's lease
    let its version be evicted without --force while the engine served it. Now another client, or a
    bare RPC without the session's token, is refused, naming the way that does work; the lease
    stands; its own client renews and releases it."""
    from preload_daemon.client import DaemonClient
    from preload_daemon.errors import AccessDeniedError
    from protos import preload_pb2 as pb
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    attached = daemon.client.attach("tiny-llama")
    [lease] = [x.id for m in daemon.client.list_models() for x in m.leases]
    with DaemonClient(daemon.config.socket_path, timeout=5) as stranger:
        for call in (stranger.release, stranger.renew):
            with pytest.raises(AccessDeniedError, match=rf"lease {lease} is held by another session "
                               rf"\(pid {os.getpid()}\).*`preload evict tiny-llama@1 --force`"):
                call(lease)
    channel = grpc.insecure_channel(f"unix:{daemon.config.socket_path}")
    release = channel.unary_unary("/preload.v1.WeightCache/Release",
                                  request_serializer=pb.ReleaseRequest.SerializeToString,
                                  response_deserializer=pb.ReleaseResponse.FromString)
    with pytest.raises(grpc.RpcError) as bare:
        release(pb.ReleaseRequest(lease_id=lease))
    assert bare.value.code() == grpc.StatusCode.PERMISSION_DENIED
    channel.close()
    with pytest.raises(LeasedError):
        daemon.client.evict("tiny-llama")
    assert daemon.client.renew(lease).id == lease
    attached.release()
    assert [m.version for m in daemon.client.evict("tiny-llama")] == [1]


def test_bad_checkpoints_leave_the_daemon_serving(daemon, tiny_llama, tmp_path):
    """Malformed input is refused with a clear error; the model already loaded stays attachable."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_llama / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="data section"):
        daemon.client.load(LoadSpec(path=str(bad)))
    assert "loading bad failed, nothing of it was kept: " in daemon.output()  # (it was in `status` alone)
    with pytest.raises(CheckpointError, match="not a directory"):
        daemon.client.load(LoadSpec(path=str(tmp_path / "nowhere")))
    for name in ("tiny@2", "tiny "):  # a name the commands could not name back (`tiny@2`: version 2 of tiny)
        with pytest.raises(InvalidRequestError, match="has an '@' or spaces at an end"):
            daemon.client.load(LoadSpec(path=str(tiny_llama), name=name))
    probe = Probe(daemon.config.socket_path, "tiny-llama", "--compare", str(tiny_llama), "--exit")
    probe.close()
    assert probe.report["equal"]
    assert [m.name for m in daemon.client.list_models()] == ["tiny-llama"]


def test_checkpoint_rewritten_in_place_is_never_served_as_the_old_one(daemon, tiny_llama, tmp_path):
    ckpt = tmp_path / "ckpt"
    tensors = copy_checkpoint(tiny_llama, ckpt)
    daemon.client.load(LoadSpec(path=str(ckpt)))
    file = ckpt / "model.safetensors"
    old = os.stat(file)
    save_file({k: v + 1 for k, v in tensors.items()}, str(tmp_path / "new"))  # same size and header: new values
    with open(file, "r+b") as f:  # written over in place, and the old mtime put back, as `cp -p` does
        f.write((tmp_path / "new").read_bytes())
    os.utime(file, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (os.stat(file).st_size, os.stat(file).st_mtime_ns, os.stat(file).st_ino) == \
        (old.st_size, old.st_mtime_ns, old.st_ino)
    with pytest.raises(StaleError, match=r"files\[.*model.safetensors\]\.ctime_ns"):
        daemon.client.attach("ckpt", files=stat_identity(ckpt))  # as an engine started on the files asks
    assert daemon.client.list_models()[0].state == "stale"
    old = daemon.client.attach("ckpt", version=1)  # v1 is still v1's weights: attaching by number works
    assert torch.equal(old["model.norm.weight"], tensors["model.norm.weight"])
    old.release()
    info = daemon.client.load(LoadSpec(path=str(ckpt)))
    assert info.version == 2 and info.active
    probe = Probe(daemon.config.socket_path, "ckpt", "--compare", str(ckpt), "--exit")
    probe.close()
    assert probe.report["version"] == 2 and probe.report["equal"]


def test_loading_the_same_checkpoint_twice_reuses_it(daemon, tiny_llama):
    first = daemon.client.load(LoadSpec(path=str(tiny_llama)))
    again = daemon.client.load(LoadSpec(path=str(tiny_llama)))
    assert (first.version, again.version) == (1, 1)
    bf16 = daemon.client.load(LoadSpec(path=str(tiny_llama), dtype="bfloat16"))
    assert bf16.version == 1 and bf16.slab_bytes < first.slab_bytes  # a variant, not a version
    [summary] = daemon.client.summaries()
    assert (summary.active_version, summary.last_version, [v.num_variants for v in summary.versions]) == (1, 1, [2])


def test_a_load_streams_its_progress_then_the_model(daemon, tmp_path):
    """The load stream: reading updates from nothing to every tensor and byte, counts that only grow
    (fewer updates than tensors: small tensors are reported together), then the model."""
    path = synthetic_checkpoint(tmp_path / "many", 0.0, num_tensors=3000)
    updates = []
    info = daemon.client.load(LoadSpec(path=str(path)), on_progress=updates.append)
    reading = [u for u in updates if u.stage == "reading"]
    assert (reading[0].tensors_done, reading[0].bytes_done) == (0, 0)
    assert [(u.tensors_done, u.bytes_done) for u in reading] == sorted((u.tensors_done, u.bytes_done) for u in reading)
    last = reading[-1]
    assert (last.tensors_done, last.bytes_done) == (last.tensors_total, last.bytes_total)
    assert last.tensors_total == info.num_tensors and len(reading) < info.num_tensors
    assert updates[-1].stage == "ready" and updates[-1].model.name == info.name == "many"


def test_variant_mismatch_names_fields(daemon, tiny_llama):
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    with pytest.raises(StaleError, match=r"dtype \('float32' here, 'bfloat16' asked\), tp_size \(1 here, 2 asked\)"):
        daemon.client.attach("tiny-llama", layout=Layout(dtype="bfloat16", tp_size=2))
    attached = daemon.client.attach("tiny-llama", layout=Layout(dtype="float32"), files=stat_identity(tiny_llama))
    assert attached.version == 1 and attached.key.dtype == "float32"


def test_health_and_reflection(daemon, tiny_llama):
    channel = grpc.insecure_channel(f"unix:{daemon.config.socket_path}")
    health = health_pb2_grpc.HealthStub(channel)
    not_serving = health.Check(health_pb2.HealthCheckRequest(service="preload.v1.WeightCache")).status
    assert not_serving == health_pb2.HealthCheckResponse.NOT_SERVING
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"preload.v1.WeightCache", "grpc.health.v1.Health"} <= names
    channel.close()


def test_http_probes(start_daemon, tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start_daemon(http_port=port)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready")
    assert err.value.code == 503
    assert json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health"))["status"] == "alive"
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    ready = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/ready"))
    assert ready["ready"] and ready["models"][0]["name"] == "tiny-llama"
    attached = daemon.client.attach("tiny-llama")
    with pytest.raises(NotFoundError):
        daemon.client.attach("no-such-model")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    bytes_ = daemon.client.list_models()[0].slab_bytes
    for line in ('preload_daemon_loads_total{outcome="ok"} 1.0', "preload_daemon_attaches_total 1.0",
                 "preload_daemon_attach_seconds_count 1.0", 'preload_daemon_errors_total{kind="NotFoundError"} 1.0',
                 f'preload_daemon_resident_bytes{{model="tiny-llama",version="1"}} {float(bytes_)}',
                 'preload_daemon_leases{model="tiny-llama",version="1"} 1.0', "preload_daemon_sessions 1.0",
                 "preload_daemon_serving 1.0", "preload_daemon_start_to_serving_seconds "):
        assert line in metrics, line
    attached.release()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'preload_daemon_leases_ended_total{how="released"} 1.0' in metrics


def test_http_probes_bound_their_connections_and_take_queries_and_other_methods(start_daemon):
    """Each connection to the probe port was a thread, kept while it sent nothing: 400 idle ones
    made 400 threads (3 GB of address space) until "can't start new thread". /metrics?x=1 was a
    404 and POST Python's HTML 501. Held idle connections kept the probes from answering."""
    from preload_daemon.daemon import MAX_PROBE_CONNECTIONS
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start_daemon(http_port=port)
    process = psutil.Process(daemon.proc.pid)
    before = process.num_threads()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_PROBE_CONNECTIONS + 40)]
    try:
        time.sleep(1.0)
        assert process.num_threads() <= before + MAX_PROBE_CONNECTIONS
        # a probe still answers while they are held: it takes the oldest one's slot (the new connection
        # was refused, so that 32 idle ones every 2 s kept every probe from answering)
        for _ in range(3):
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
        assert process.num_threads() <= before + MAX_PROBE_CONNECTIONS
    finally:
        for conn in idle:
            conn.close()
    deadline = time.monotonic() + 30
    while True:  # their threads see the close and end; the probes answer again
        try:
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?x=1", timeout=5).status == 200
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/health", b"{}", method="POST"))
    assert err.value.code == 405 and "GET /health, /ready or /metrics" in json.load(err.value)["error"]
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/health", method="OPTIONS"))
    assert err.value.code == 501 and json.load(err.value)["error"].startswith("501 Unsupported method")
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as slow:  # a drip of bytes is cut at 2 s
        started, cut = time.monotonic(), False
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        while not cut and time.monotonic() - started < 10:
            try:
                slow.sendall(b"X")
                cut = slow.recv(4096) == b""
            except TimeoutError:
                continue
            except OSError:
                cut = True
        assert cut and time.monotonic() - started < 5


def test_verify_detects_a_slab_written_behind_the_daemons_back(daemon, tiny_llama):
    """A same-uid process can chmod a slab back and write it; `preload verify` (and adoption by a
    restarted daemon) re-hashes it and says so."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    assert [c.ok for c in daemon.client.verify().slabs] == [True]
    [slab] = daemon.config.shm_dir.glob("*.slab")
    os.chmod(slab, 0o600)
    with open(slab, "r+b") as f:
        f.seek(4096)
        f.write(b"\x01")
    [check] = daemon.client.verify("tiny-llama", 1).slabs
    assert not check.ok and check.expected != check.actual
    out = run_preload("verify", runtime_dir=daemon.config.runtime_dir)
    assert out.returncode == 1 and "CHANGED" in out.stdout and "changed after they were sealed" in out.stderr
    assert "was changed after it was sealed" in daemon.output()
    # and it is handed out no more (a new attach got the written bytes, and status said ready)
    with pytest.raises(NotFoundError, match=r"tiny-llama v1 on cpu:0 is damaged \(its bytes changed after it was "
                                            r"sealed: digest .*`preload evict tiny-llama@1 --force`, then load it"):
        daemon.client.attach("tiny-llama")
    assert [v.state for m in daemon.client.stats().summaries for v in m.versions] == ["damaged"]
    with pytest.raises(StaleError, match="is damaged .* so it is not made active"):  # (a rollback said it was)
        daemon.client.set_active("tiny-llama", 1)
    out = run_preload("wait-ready", "--model", "tiny-llama", "--timeout", "5", runtime_dir=daemon.config.runtime_dir)
    assert out.returncode == 3 and "is damaged" in out.stderr, out.stderr


def test_a_slab_file_truncated_behind_the_daemons_back_is_said_by_verify_not_a_crash(daemon, tiny_llama):
    """Hashing the mapping past a truncated file's end killed the daemon with SIGBUS in `preload verify`."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    [slab] = daemon.config.shm_dir.glob("*.slab")
    size = slab.stat().st_size
    os.truncate(slab, 8192)
    with pytest.raises(NotFoundError, match=f"was truncated to 8192 bytes from {size} behind the daemon's back"):
        daemon.client.attach("tiny-llama")
    [check] = daemon.client.verify("tiny-llama", 1).slabs
    assert not check.ok and check.actual == f"gone: file truncated to 8192 bytes from {size}"
    assert daemon.proc.poll() is None
    with pytest.raises(NotFoundError, match=r"is damaged \(file truncated to 8192 bytes"):
        daemon.client.attach("tiny-llama")


def test_a_slab_file_deleted_behind_the_daemons_back_is_said_by_attach_and_verify(daemon, tiny_llama):
    """`rm` in /dev/shm (or logind's RemoveIPC at logout): status said ready, verify said ok (it
    hashes its own mapping), and attach told the engine the slab was evicted, to attach again."""
    from preload_daemon.errors import NotFoundError
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    attached = daemon.client.attach("tiny-llama")
    [slab] = daemon.config.shm_dir.glob("*.slab")
    slab.unlink()
    try:
        assert attached[next(iter(attached))].view(-1)[0].item() is not None  # still mapped: still served
        with pytest.raises(NotFoundError, match=r"the slab file of tiny-llama v1 on cpu:0 \(.*\.slab\) was deleted "
                                                r"behind the daemon's back; .*`preload evict tiny-llama@1 --force`"):
            daemon.client.attach("tiny-llama")
        [check] = daemon.client.verify("tiny-llama", 1).slabs
        assert not check.ok and check.actual == "gone: file deleted"
        out = run_preload("verify", runtime_dir=daemon.config.runtime_dir)
        assert out.returncode == 1 and "GONE: FILE DELETED" in out.stdout
        assert "deleted, replaced or resized" in out.stderr
    finally:
        attached.release()
    daemon.client.evict("tiny-llama", 1, True)  # and a load makes it anew
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    daemon.client.attach("tiny-llama").release()


def test_a_daemon_whose_socket_is_removed_says_so(daemon):
    """Its runtime dir cleaned up under it: `preload status` found no daemon, and the daemon, alive
    with its slabs, said nothing."""
    from tests.conftest import wait_until
    moved = daemon.config.socket_path.with_name("moved.sock")
    daemon.config.socket_path.rename(moved)
    try:
        wait_until(lambda: "was removed or replaced (its runtime directory cleaned up?)" in daemon.output(), 10,
                   "the daemon to say its socket is gone")
    finally:
        moved.rename(daemon.config.socket_path)


def test_oversized_and_malformed_requests(daemon, tiny_llama):
    from protos import preload_pb2 as pb
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    channel = grpc.insecure_channel(f"unix:{daemon.config.socket_path}",
                                    options=[("grpc.max_send_message_length", 200 << 20)])
    attach = channel.unary_unary("/preload.v1.WeightCache/Attach",
                                 request_serializer=pb.AttachRequest.SerializeToString,
                                 response_deserializer=pb.AttachResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        attach(pb.AttachRequest(model="x" * (100 << 20)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = channel.unary_unary("/preload.v1.WeightCache/Attach")
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff garbage", timeout=10)
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as err:
        attach(pb.AttachRequest(model=""), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    assert daemon.client.attach("tiny-llama").version == 1


def test_other_uid_cannot_use_the_socket(daemon, tiny_llama):
    """As `nobody`: the kernel refuses the connection (private directory), and the client says whose
    daemon it is; with the directory opened up, the session socket's SO_PEERCRED check refuses the
    session, so nobody gets a lease."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as nobody")
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    # Imports happen as root (the interpreter and the checkout may be readable by root alone: grpc
    # imports parts of itself when the first channel is made, so the client is made as root too);
    # the connection and the call run as nobody.
    script = (
        "import os, sys\n"
        "from preload_daemon.client import DaemonClient\n"
        "from preload_daemon.errors import PreloadError\n"
        "from preload_cli.main import main\n"
        "import preload_cli.daemon_commands, preload_daemon.versions  # `status` imports them, as nobody by then\n"
        "client = DaemonClient(%r, timeout=5)\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "try:\n    client.attach('tiny-llama')\n    print('ATTACHED')\n"
        "except PreloadError as e:\n    print(type(e).__name__, e)\n"
        "print('status exit', main(['status', '--runtime-dir', %r]))\n"
    ) % (str(daemon.config.socket_path), str(daemon.config.runtime_dir))

    def as_nobody() -> str:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
        return out.stdout + out.stderr

    out = as_nobody()
    assert "AccessDeniedError permission denied: this daemon serves uid 0, and you are uid 65534" in out, out
    assert "preload status: permission denied: " in out and "is private to uid 0 (its daemons serve that user), and " \
        "you are uid 65534" in out and "status exit 1" in out, out
    runtime, sessions = daemon.config.runtime_dir, session_path(daemon.config.socket_path)
    os.chmod(runtime, 0o755)
    os.chmod(sessions, 0o777)
    try:
        out = as_nobody()
    finally:
        os.chmod(runtime, 0o700)
        os.chmod(sessions, 0o600)
    assert "AccessDeniedError" in out and "this daemon serves uid 0" in out, out
    assert "refused a session of uid 65534" in daemon.output()
    assert daemon.client.attach("tiny-llama").version == 1


def test_sigterm_frees_slabs_and_socket(daemon, tiny_llama):
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    slab = pathlib.Path(daemon.client.attach("tiny-llama").manifest.slabs[0].path)
    assert slab.exists()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(15) == 0
    assert not slab.exists() and not daemon.config.socket_path.exists()
    assert not daemon.config.shm_dir.exists(), "an empty slab directory is left behind"
