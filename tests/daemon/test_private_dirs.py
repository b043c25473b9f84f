"""The runtime dir and the shared-memory dir live in world-writable places (/tmp, /dev/shm): a
stranger's symlink or directory planted at their names must be refused, never followed or chmod-ed.
The tests run as root, so "a stranger" is a directory chown-ed to nobody (65534); /dev/shm is
stood in for by a temporary directory."""

import hashlib
import os
import pathlib
import re
import socket
import stat
import subprocess
import threading

import pytest

from preload_daemon.errors import InvalidRequestError
from preload_daemon.runtime_dir import SHM_RECORD, ensure_private_dir, shm_dir_for

NOBODY = 65534


@pytest.fixture
def shm_root(tmp_path) -> pathlib.Path:
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o1777)
    return root


@pytest.fixture
def elsewhere(tmp_path) -> pathlib.Path:
    """A directory a symlink may point to; open to all, as an attacker's target would be."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    return target


def mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def planted_record(runtime: pathlib.Path, name: str = "preload-0123456789abcdef") -> str:
    runtime.mkdir(mode=0o700)
    (runtime / SHM_RECORD).write_text(name + "\n")
    return name


def test_creates_private_dir_and_parents(tmp_path):
    path = ensure_private_dir(tmp_path / "a" / "b" / "run")
    assert path.is_dir() and mode(path) == 0o700 and mode(tmp_path / "a") == 0o700


def test_existing_parents_are_left_alone(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o755)
    ensure_private_dir(parent / "run")
    assert mode(parent) == 0o755 and mode(parent / "run") == 0o700


def test_open_dir_is_made_private(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    os.chmod(path, 0o755)
    ensure_private_dir(path)
    assert mode(path) == 0o700


def test_symlinked_runtime_dir_is_refused(tmp_path, elsewhere, shm_root):
    runtime = tmp_path / "run"
    runtime.symlink_to(elsewhere)
    for make in (lambda: ensure_private_dir(runtime), lambda: shm_dir_for(runtime, shm_root)):
        with pytest.raises(InvalidRequestError, match=rf"{runtime} is a symbolic link .*PRELOAD_RUNTIME_DIR"):
            make()
    assert mode(elsewhere) == 0o755 and not list(elsewhere.iterdir()) and not list(shm_root.iterdir())


def test_dangling_symlink_is_refused(tmp_path):
    runtime = tmp_path / "run"
    runtime.symlink_to(tmp_path / "not-yet")
    with pytest.raises(InvalidRequestError, match="symbolic link"):
        ensure_private_dir(runtime)
    assert not (tmp_path / "not-yet").exists()


def test_strangers_dir_is_refused(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o755)
    os.chown(runtime, NOBODY, NOBODY)
    with pytest.raises(InvalidRequestError, match=rf"belongs to uid {NOBODY}.*PRELOAD_RUNTIME_DIR"):
        ensure_private_dir(runtime)
    assert mode(runtime) == 0o755


def test_file_at_the_name_is_refused(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(InvalidRequestError, match="not a directory"):
        ensure_private_dir(tmp_path / "run")


def test_shm_dir_is_random_private_and_stable(tmp_path, shm_root):
    runtime = tmp_path / "run"
    first = shm_dir_for(runtime, shm_root)
    assert re.fullmatch(r"preload-[0-9a-f]{16}", first.name) and first.parent == shm_root
    assert mode(first) == 0o700 and mode(runtime) == 0o700
    assert (runtime / SHM_RECORD).read_text() == first.name + "\n"
    assert shm_dir_for(runtime, shm_root) == first


def test_shm_dir_name_is_not_derived_from_runtime_dir(tmp_path, shm_root):
    """The same runtime dir path, made afresh, gets another name: nothing about it can be guessed."""
    runtime = tmp_path / "run"
    first = shm_dir_for(runtime, shm_root)
    (runtime / SHM_RECORD).unlink()
    assert shm_dir_for(runtime, shm_root) != first
    old_scheme = hashlib.sha256(str(runtime.resolve()).encode()).hexdigest()[:12]  # preload-UID-HASH
    assert old_scheme not in first.name and not first.name.startswith(f"preload-{os.getuid()}-")


def test_vanished_shm_dir_is_replaced_by_a_new_one(tmp_path, shm_root):
    runtime = tmp_path / "run"
    first = shm_dir_for(runtime, shm_root)
    first.rmdir()  # a reboot empties /dev/shm
    second = shm_dir_for(runtime, shm_root)
    assert second != first and second.is_dir() and not first.exists()
    assert (runtime / SHM_RECORD).read_text() == second.name + "\n"
    assert [p.name for p in runtime.iterdir()] == [SHM_RECORD], "a temporary record file was left behind"


def test_symlink_at_shm_dir_is_passed_by(tmp_path, elsewhere, shm_root):
    """A symlink planted at the recorded name (free once the directory was removed) is neither
    followed nor removed: a new directory is made and recorded, so nobody can block the daemon."""
    runtime = tmp_path / "run"
    name = planted_record(runtime)
    (shm_root / name).symlink_to(elsewhere)
    path = shm_dir_for(runtime, shm_root)
    assert path.name != name and path.is_dir() and (runtime / SHM_RECORD).read_text() == path.name + "\n"
    assert (shm_root / name).is_symlink() and mode(elsewhere) == 0o755 and not list(elsewhere.iterdir())


def test_strangers_shm_dir_is_passed_by(tmp_path, shm_root):
    runtime = tmp_path / "run"
    name = planted_record(runtime)
    (shm_root / name).mkdir(mode=0o777)
    os.chown(shm_root / name, NOBODY, NOBODY)
    path = shm_dir_for(runtime, shm_root)
    assert path.name != name and os.stat(path).st_uid == os.getuid() and mode(path) == 0o700
    assert os.stat(shm_root / name).st_uid == NOBODY


def test_open_shm_dir_is_made_private(tmp_path, shm_root):
    runtime = tmp_path / "run"
    first = shm_dir_for(runtime, shm_root)
    os.chmod(first, 0o777)
    assert shm_dir_for(runtime, shm_root) == first and mode(first) == 0o700


@pytest.mark.parametrize("content", ["", "preload-xyz", "../../etc", "preload-0123456789abcdef/../x",
                                     "preload-" + "0" * 200, "\x00\xff garbage"])
def test_corrupt_record_is_replaced_with_a_new_dir(tmp_path, shm_root, content):
    """A record that is not a name we write (e.g. torn by a crash) is never used as a path: a new
    directory is made and the record rewritten."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    (runtime / SHM_RECORD).write_bytes(content.encode("latin-1"))
    path = shm_dir_for(runtime, shm_root)
    assert path.parent == shm_root and path.is_dir() and [p.name for p in shm_root.iterdir()] == [path.name]
    assert (runtime / SHM_RECORD).read_text() == path.name + "\n"


def test_record_that_is_not_a_file_is_refused(tmp_path, shm_root):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    (runtime / SHM_RECORD).symlink_to(tmp_path / "elsewhere-record")
    with pytest.raises(InvalidRequestError, match=f"cannot read {runtime / SHM_RECORD}.*delete it"):
        shm_dir_for(runtime, shm_root)
    (runtime / SHM_RECORD).unlink()
    os.mkfifo(runtime / SHM_RECORD)  # must not hang
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        shm_dir_for(runtime, shm_root)
    assert not list(shm_root.iterdir())


def test_concurrent_daemons_get_one_shm_dir(tmp_path, shm_root):
    """Daemons of one runtime dir starting at once (threads here: each call locks its own open
    file description, as separate processes would) all get the directory that only one made."""
    runtime = tmp_path / "run"
    start, results = threading.Barrier(8), []

    def daemon():
        start.wait()
        results.append(shm_dir_for(runtime, shm_root))

    threads = [threading.Thread(target=daemon) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1 and list(shm_root.iterdir()) == [results[0]]


def bound_socket(path: pathlib.Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return sock


def test_a_client_refuses_a_strangers_runtime_dir_and_its_sockets(tmp_path):
    """Clients (status, evict, attach, engines) trusted any runtime dir: a stranger who made
    /tmp/preload-$UID first, with links to their own daemon's sockets, named the slabs we mapped."""
    from preload_daemon.client import DaemonClient
    from preload_daemon.runtime_dir import check_daemon_socket
    from preload_daemon.session_client import open_session
    from preload_daemon.versions import daemon_sockets
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    real = bound_socket(ours / "daemon-cpu-0.sock")
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o777)
    (planted / "daemon-cpu-0.sock").symlink_to(ours / "daemon-cpu-0.sock")
    (planted / "session-cpu-0.sock").symlink_to(ours / "daemon-cpu-0.sock")
    os.chown(planted, NOBODY, NOBODY)
    os.chmod(planted, 0o777)
    try:
        check_daemon_socket(ours / "daemon-cpu-0.sock")  # a socket of ours, in a dir of ours: fine
        message = rf"{planted} \(owned by uid {NOBODY}, mode 0777\) is not a directory of ours or root's"
        for connect in (lambda: daemon_sockets(planted), lambda: DaemonClient(planted / "daemon-cpu-0.sock").stats(),
                        lambda: open_session(planted / "session-cpu-0.sock")):
            with pytest.raises(InvalidRequestError, match=message + ".*PRELOAD_RUNTIME_DIR"):
                connect()
        os.chown(planted, 0, 0)
        os.chmod(planted, 0o700)  # a dir of ours, but the socket a link a stranger could aim anywhere
        with pytest.raises(InvalidRequestError, match="daemon-cpu-0.sock is a symbolic link, not a daemon socket"):
            check_daemon_socket(planted / "daemon-cpu-0.sock")
        os.chown(ours / "daemon-cpu-0.sock", NOBODY, NOBODY)
        with pytest.raises(InvalidRequestError, match=f"is owned by uid {NOBODY}, not a daemon socket"):
            check_daemon_socket(ours / "daemon-cpu-0.sock")
    finally:
        real.close()


def test_status_refuses_a_strangers_runtime_dir(tmp_path):
    from tests.conftest import run_preload
    planted = tmp_path / "planted"
    planted.mkdir()
    bound_socket(planted / "daemon-cpu-0.sock").close()
    os.chown(planted, NOBODY, NOBODY)
    out = run_preload("status", runtime_dir=planted)
    assert out.returncode == 1 and "can plant a daemon socket" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("parent_mode, owner, refused", [
    (0o777, 0, "is writable by others \\(mode 0777\\) and not sticky"),
    (0o755, NOBODY, f"belongs to uid {NOBODY}, not to us"),
    (0o1777, 0, None),  # sticky, as /tmp: no one can rename another's entry
])
def test_a_runtime_dir_under_a_directory_others_control_is_refused(tmp_path, parent_mode, owner, refused):
    """Whoever controls a directory above can rename ours away and put theirs in its place (a root
    daemon given a user's $XDG_RUNTIME_DIR; a snapshot moved under a world-writable directory)."""
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chown(parent, owner, owner)
    os.chmod(parent, parent_mode)
    if refused is None:
        assert mode(ensure_private_dir(parent / "run")) == 0o700
        return
    with pytest.raises(InvalidRequestError, match=rf"{parent}, above {parent / 'run' / 'deeper'}, {refused}"):
        ensure_private_dir(parent / "run" / "deeper")
    assert not (parent / "run").exists()  # refused before anything was made there (it would lock its owner out)


def test_the_socket_dirs_of_routers_killed_are_removed_and_no_other(runtime_dir):
    """A data-parallel router killed with SIGKILL left engine-PID-HEX and its replicas' sockets in
    the runtime dir for good. The next router removes such a directory once its process is gone and
    nothing listens on its sockets; one of a live process, one with a listener or with anything but
    sockets in it, and other names, stay."""
    from preload_daemon.runtime_dir import remove_dead_routers_dirs
    runtime = ensure_private_dir(runtime_dir)  # (short: a socket's path has room for 107 bytes)
    child = subprocess.Popen(["true"])
    child.wait()
    dead = child.pid  # a process gone (and reaped)
    listening = socket.socket(socket.AF_UNIX)

    def router_dir(name: str, listen: bool = False) -> pathlib.Path:
        path = runtime / name
        path.mkdir()
        for i in range(2):
            sock = listening if listen and i == 0 else socket.socket(socket.AF_UNIX)
            sock.bind(str(path / f"replica-{i}.sock"))
            if sock is listening:
                sock.listen()
            else:
                sock.close()
        return path

    gone = router_dir(f"engine-{dead}-0123abcd")
    alive = router_dir(f"engine-{os.getpid()}-0123abcd")
    heard = router_dir(f"engine-{dead}-4567abcd", listen=True)
    other = router_dir(f"engine-{dead}-89abcdef")
    (other / "notes.txt").write_text("not a socket")
    named = router_dir(f"engine-{dead}-xyz")
    try:
        remove_dead_routers_dirs(runtime)
        assert not gone.exists()
        assert all(p.exists() for p in (alive, heard, other, named))
    finally:
        listening.close()
