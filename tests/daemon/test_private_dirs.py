"""The runtime dir and the shared-memory dir live in world-writable places (/tmp, /dev/shm): a
stranger's symlink or directory planted at their names must be refused, never followed or chmod-ed.
The tests run as root, so "a stranger" is a directory chown-ed to nobody (65534); /dev/shm is
stood in for by a temporary directory."""

import hashlib
import os
import pathlib
import re
import stat
import threading

import pytest

from preload_daemon.config import SHM_RECORD, ensure_private_dir, shm_dir_for
from preload_daemon.errors import InvalidRequestError

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
