"""The connection model: sessions tie leases to processes through the kernel (SO_PEERCRED and the
connection's close), with a cap, back-off on accept errors, no thread per connection and no name
a stranger could bind first."""

import os
import resource
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from preload_daemon.client import DaemonClient
from preload_daemon.plan import LoadSpec
from preload_daemon.session_client import SessionError, open_session
from preload_daemon.sessions import SessionServer, session_path
from tests.conftest import REPO, wait_until


@pytest.fixture
def sessions(tmp_path):
    closed = []
    server = SessionServer(tmp_path / "session-cpu-0.sock", closed.append, max_sessions=3)
    server.start()
    server.closed = closed
    yield server
    server.close()


def test_a_session_names_the_callers_pid_and_ends_when_it_closes(sessions):
    sock, token = open_session(sessions.path)
    session = sessions.get(token)
    assert (session.pid, session.uid) == (os.getpid(), os.getuid())
    assert oct(os.stat(sessions.path).st_mode & 0o777) == "0o600"
    sock.close()
    wait_until(lambda: sessions.get(token) is None, what="the session to end")
    assert [s.token for s in sessions.closed] == [token]


def test_the_cap_refuses_with_a_clear_message(sessions):
    held = [open_session(sessions.path)[0] for _ in range(3)]
    with pytest.raises(SessionError, match=r"too many sessions: this daemon holds 3 \(its --max-sessions\)"):
        open_session(sessions.path)
    from preload_daemon.client import DaemonClient
    from preload_daemon.errors import DaemonUnavailableError
    client = DaemonClient(sessions.path.with_name("daemon-cpu-0.sock"))  # (it told the caller to start the daemon)
    with pytest.raises(DaemonUnavailableError) as err:
        client.session()
    assert "refused a session: too many sessions" in str(err.value) and "start the daemon" not in str(err.value)
    assert sessions.refused == 2
    held.pop().close()
    wait_until(lambda: len(sessions) == 2, what="a slot to free")
    held.append(open_session(sessions.path)[0])
    for sock in held:
        sock.close()


def test_accept_errors_back_off_and_recover(sessions, caplog):
    """Out of file descriptors (EMFILE): accept fails, is logged and retried; the server is not deaf
    once descriptors are free again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    try:
        # The limit at the lowest free descriptor number: every number below it is taken, so the
        # server's accept() has none left. Connecting takes no new descriptor.
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_fd(), hard))
        for c in clients:
            c.setblocking(False)
            c.connect_ex(str(sessions.path))
        wait_until(lambda: sessions.accept_errors > 0, timeout=5, what="an accept error")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for c in clients:
            c.close()
    assert "accept() on" in caplog.text and "accepting again in" in caplog.text
    opened = []

    def reopen() -> bool:  # the backlog's closed connections come through (and end) first
        try:
            opened.append(open_session(sessions.path, timeout=10))
            return True
        except SessionError:
            return False
    wait_until(reopen, timeout=10, what="a new session after the back-off")
    sock, token = opened[0]
    assert sessions.get(token) is not None
    sock.close()



def test_clients_that_stop_reading_hold_no_thread_and_end_after_the_send_timeout(tmp_path, monkeypatch, caplog):
    """What of an answer the socket cannot take at once is sent by the selector thread as the client
    reads. More clients that stop reading than there are request threads (processes stopped with
    SIGSTOP or frozen by their cgroup) delay no one else; one that reads again gets its whole
    answer and is served on; one that closes is ended at once, and one that never reads after
    SEND_TIMEOUT_S."""
    import struct

    from preload_daemon import sessions as sessions_module
    from preload_daemon.session_client import _recv_exactly, request
    from preload_daemon.sessions import ATTACH, REQUEST_THREADS
    monkeypatch.setattr(sessions_module, "SEND_TIMEOUT_S", 3.0)
    answer = os.urandom(1 << 20) * 4  # far over what a socket's buffers hold
    server = SessionServer(tmp_path / "session-cpu-0.sock", lambda session: None,
                           on_request=lambda session, kind, payload: answer)
    server.start()
    frozen = [open_session(server.path) for _ in range(REQUEST_THREADS + 2)]
    try:
        for sock, _ in frozen:
            sock.sendall(struct.pack(">IB", 0, ATTACH))  # and then reads nothing
        sock, token = open_session(server.path)
        assert request(sock, ATTACH, b"", 2.0) == answer  # within 2 s: not after a frozen one's 3 s
        assert all(server.get(t) for _, t in frozen)

        reader = frozen[0][0]
        reader.settimeout(10)
        assert struct.unpack(">IB", _recv_exactly(reader, 5)) == (len(answer), ATTACH)
        assert _recv_exactly(reader, len(answer)) == answer
        assert request(reader, ATTACH, b"", 10) == answer
        frozen[1][0].close()  # ended at once, not at the send timeout
        wait_until(lambda: server.get(frozen[1][1]) is None, timeout=1, what="a closed client's session to end")
        assert "its connection failed while it was sent an answer" in caplog.text
        wait_until(lambda: not any(server.get(t) for _, t in frozen[2:]), timeout=15,
                   what="the sessions that never read to end")
        assert server.get(frozen[0][1]) and server.get(token)
        assert "did not read its answer within 3 s" in caplog.text
        assert request(sock, ATTACH, b"", 10) == answer
        sock.close()
    finally:
        for s, _ in frozen:
            s.close()
        server.close()


@pytest.mark.parametrize("read_first", [0, 3 << 20])
def test_unread_answers_past_the_budget_end_the_sessions_that_waited_longest(tmp_path, monkeypatch, caplog,
                                                                              read_first):
    """Each session that stops reading holds one unread answer: without a bound, 200 of them held
    800 MiB of the daemon's memory for SEND_TIMEOUT_S. One that reads most of its answer first
    still holds all of it (what is left to send is a view of the whole frame)."""
    import struct

    from preload_daemon import sessions as sessions_module
    from preload_daemon.session_client import _recv_exactly
    from preload_daemon.sessions import ATTACH
    monkeypatch.setattr(sessions_module, "UNSENT_BUDGET", 6 << 20)
    answer = os.urandom(1 << 20) * 4
    server = SessionServer(tmp_path / "session-cpu-0.sock", lambda session: None,
                           on_request=lambda session, kind, payload: answer)
    server.start()
    frozen = [open_session(server.path) for _ in range(3)]
    try:
        for sock, token in frozen:
            sock.sendall(struct.pack(">IB", 0, ATTACH))
            _recv_exactly(sock, read_first)
            wait_until(lambda: token in {getattr(server._sockets.get(c), "token", "") for c in list(server._sending)},
                       timeout=5, what="its answer to wait")
        wait_until(lambda: [bool(server.get(t)) for _, t in frozen] == [False, False, True], timeout=5,
                   what="the two sessions that waited longest to end")
        assert "unread answers held over 6 MiB of the daemon's memory" in caplog.text
    finally:
        for sock, _ in frozen:
            sock.close()
        server.close()

def lowest_free_fd() -> int:
    n = 0
    while True:
        try:
            os.fstat(n)
        except OSError:
            return n
        n += 1


def test_idle_connections_cost_no_threads_and_no_name_can_be_squatted(daemon, tiny_llama):
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    proc = psutil.Process(daemon.proc.pid)
    threads = proc.num_threads()
    clients = [DaemonClient(daemon.config.socket_path, timeout=10) for _ in range(100)]
    held = [open_session(session_path(daemon.config.socket_path))[0] for _ in range(100)]
    for client in clients:
        client.stats()  # a gRPC connection each
    assert daemon.client.stats().num_sessions == 100
    assert proc.num_threads() <= threads + 4, f"{proc.num_threads()} threads against {threads} before"
    # Every socket the daemon has is a file in its private directory (or unnamed): no abstract name
    # that another user could read from /proc/net/unix and bind first.
    names = {c.laddr for c in proc.net_connections(kind="unix") if c.laddr}
    assert names and all(n.startswith(str(daemon.config.runtime_dir)) for n in names), names
    for c in clients:
        c.close()
    for s in held:
        s.close()
    wait_until(lambda: daemon.client.stats().num_sessions == 0, what="the sessions to close")


def test_a_zombie_holds_no_lease(daemon, tiny_llama):
    """A worker that exits but is never reaped by its parent (a zombie) has no lease left: the
    kernel closed its session when it exited."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    script = ("import sys, time\nfrom preload_daemon.client import DaemonClient\n"
              "m = DaemonClient(sys.argv[1]).attach('tiny-llama')\nprint('attached', flush=True)\ntime.sleep(0.5)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(daemon.config.socket_path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "attached"
    wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what="the child to be a zombie")
    wait_until(lambda: not daemon.client.list_models()[0].leases, timeout=5, what="the zombie's lease to end")
    child.wait()


def test_attach_without_a_session_is_refused(daemon, tiny_llama):
    import grpc

    from protos import preload_pb2 as pb
    from protos import preload_pb2_grpc as pb_grpc
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    with grpc.insecure_channel(f"unix:{daemon.config.socket_path}") as channel:
        stub = pb_grpc.WeightCacheStub(channel)
        for session in ("", "0" * 32, "x" * 10_000):
            with pytest.raises(grpc.RpcError) as err:
                stub.Attach(pb.AttachRequest(model="tiny-llama", session=session), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "Attach needs the token of an open session" in err.value.details()
    assert not daemon.client.list_models()[0].leases


def test_many_threads_attach_and_release_at_once(daemon, tiny_llama):
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    errors = []

    def worker() -> None:
        try:
            with DaemonClient(daemon.config.socket_path, timeout=30) as client:
                for _ in range(10):
                    client.attach("tiny-llama").release()
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not daemon.client.list_models()[0].leases
    print(f"80 attach/release from 8 threads in {time.monotonic() - start:.2f}s")


def test_a_client_opens_a_new_session_with_a_restarted_daemon(daemon, tiny_llama, start_daemon):
    client = DaemonClient(daemon.config.socket_path, timeout=30)
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    client.attach("tiny-llama")
    daemon.proc.kill()
    daemon.proc.wait()
    assert client.wait_session_closed(5)
    successor = start_daemon()  # adopts the slab
    attached = client.attach("tiny-llama")  # the old session's token would be unknown to it
    assert attached.version == 1 and [lease.pid for lease in successor.client.list_models()[0].leases] == [os.getpid()]
    client.close()


def test_attach_travels_on_the_session_and_bad_frames_get_clear_errors(daemon, tiny_llama):
    """Attach is one framed request on the session: no gRPC in the attaching process. A garbled
    payload or an unknown kind gets an error answer and the session goes on serving; a frame over
    the size limit ends the session (and only that one)."""
    import struct

    from preload_daemon.errors import InvalidRequestError, NotFoundError
    from preload_daemon.session_client import SessionAnswerError, request
    from preload_daemon.sessions import ATTACH, MAX_REQUEST
    from protos import preload_pb2 as pb
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    script = ("import sys\nfrom preload_daemon.client import DaemonClient\n"
              "m = DaemonClient(sys.argv[1]).attach('tiny-llama')\n"
              "print(len(m.tensors), 'grpc' in sys.modules, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script, str(daemon.config.socket_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(daemon.client.list_models()[0].num_tensors), "False"], out.stderr

    sock, token = open_session(session_path(daemon.config.socket_path))
    for kind, payload, error in ((ATTACH, b"\xff\xff\xff", "not an AttachRequest"), (ord("Z"), b"", "unknown session"),
                                 (ATTACH, pb.AttachRequest(model="nope").SerializeToString(), "NotFoundError")):
        with pytest.raises(SessionAnswerError, match=error):
            request(sock, kind, payload, 10)
    answer = pb.AttachResponse.FromString(
        request(sock, ATTACH, pb.AttachRequest(model="tiny-llama").SerializeToString(), 10))
    lease = next(l for l in daemon.client.list_models()[0].leases if l.id == answer.lease.id)
    assert lease.pid == os.getpid()
    with pytest.raises(InvalidRequestError, match="over the session's limit"):  # refused before it is sent
        request(sock, ATTACH, bytes(MAX_REQUEST + 1), 10)
    assert daemon.client.list_models()[0].leases  # the session and its lease live on
    sock.sendall(struct.pack(">IB", MAX_REQUEST + 1, ATTACH))
    assert sock.recv(1 << 16)[5:].startswith(b"InvalidRequestError: a ")
    wait_until(lambda: not daemon.client.list_models()[0].leases, what="the session's lease to end")
    sock.close()

    client = DaemonClient(daemon.config.socket_path, timeout=10)  # errors come back as their own class
    with pytest.raises(NotFoundError):
        client.attach("nope")
    with pytest.raises(InvalidRequestError, match="model name"):
        client.attach("bad\nname")
    client.attach("tiny-llama").release()
    client.close()
