"""The runtime directory (sockets, locks, logs) and the shared-memory directory of the slabs:
made private (0700, ours), and checked before anything in them is trusted, since other processes on
the host can plant files, links and sockets; and the paths within them. Where the runtime directory
is, is configuration (config.default_runtime_dir)."""

import fcntl
import logging
import os
import pathlib
import re
import secrets
import socket
import stat

from preload_daemon.errors import InvalidRequestError

log = logging.getLogger(__name__)


RUNTIME_DIR_FIX = "set PRELOAD_RUNTIME_DIR to a directory of your own"


def ensure_private_dir(path: pathlib.Path, fix: str = RUNTIME_DIR_FIX) -> pathlib.Path:
    """Creates `path` with mode 0700, or checks that an existing one is ours and private. It lives in
    shared places (/tmp, /dev/shm) where a stranger may have planted a symlink or a directory of
    their own at the name first, so nothing here follows a symlink at `path`, and a mode is fixed
    through a file descriptor, never by path. `fix` is what the error tells the user to do."""
    check_ancestors(pathlib.Path(path), fix)  # first: nothing is made below a directory a stranger controls
    _make_dirs(pathlib.Path(path))
    return _check_own_dir(pathlib.Path(path), fix)


def _make_dirs(path: pathlib.Path) -> None:
    """mkdir -p with mode 0700 for every directory it creates; existing ones are left alone."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    except FileNotFoundError:
        if path.parent == path:
            raise
        _make_dirs(path.parent)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass


def check_private_dir(path: pathlib.Path, fix: str = RUNTIME_DIR_FIX) -> pathlib.Path:
    """Refuses `path` unless it is a real directory (not a symlink) owned by us, below directories
    no stranger controls (check_ancestors); drops group and other permissions if it has any.
    Raises FileNotFoundError if it does not exist."""
    check_ancestors(path, fix)
    return _check_own_dir(path, fix)


def _check_own_dir(path: pathlib.Path, fix: str) -> pathlib.Path:
    """check_private_dir of `path` itself, the directories above it already checked."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise InvalidRequestError(f"{path} is a symbolic link (to {os.readlink(path)}), not a directory; "
                                  f"refusing to follow it, since whoever made it chooses where it points. {fix}")
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidRequestError(f"{path} exists but is not a directory; {fix}")
    if info.st_uid != os.getuid():
        raise InvalidRequestError(f"{path} belongs to uid {info.st_uid}, not to us ({os.getuid()}); remove it if it "
                                  f"is empty (`rmdir {path}`, as its owner), or {fix}")
    if info.st_mode & 0o077:
        _make_private(path, info, fix)
    return path


def check_ancestors(path: pathlib.Path, fix: str = RUNTIME_DIR_FIX) -> None:
    """Refuses `path` if a directory above it lets a stranger rename it away and put one of theirs
    in its place (as sshd's StrictModes does): each must be ours or root's, and writable by no one
    else unless sticky (/tmp, /dev/shm). Checked along the path as given (each directory that holds
    a link on the way, so no stranger can re-aim one) and along the real path it resolves to; those
    that do not exist yet are skipped (whoever makes them owns them)."""
    given = pathlib.Path(os.path.abspath(path)).parent
    real = pathlib.Path(os.path.realpath(given))
    for directory in dict.fromkeys((given, *given.parents, real, *real.parents)):
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            continue
        if info.st_uid not in (os.geteuid(), 0):
            raise InvalidRequestError(f"{directory}, above {path}, belongs to uid {info.st_uid}, not to us "
                                      f"({os.geteuid()}) or root: its owner can swap {path} for a directory of "
                                      f"theirs; {fix}")
        if others_can_write(info) and not info.st_mode & stat.S_ISVTX:
            raise InvalidRequestError(f"{directory}, above {path}, is writable by others (mode "
                                      f"{stat.S_IMODE(info.st_mode):04o}) and not sticky: anyone can swap {path} for "
                                      f"a directory of theirs; `chmod go-w {directory}` (or `chmod +t` for a shared "
                                      f"one), or {fix}")


def others_can_write(info: os.stat_result) -> bool:
    """Write permission for anyone but the owner: for all, or for a group that is not the owner's
    own (a group of the user's name with no other member, as umask 002 systems make them)."""
    if info.st_mode & 0o002:
        return True
    return bool(info.st_mode & 0o020) and not _private_group(info.st_gid, info.st_uid)


def _private_group(gid: int, uid: int) -> bool:
    import grp
    import pwd
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    return group.gr_name == user.pw_name and user.pw_gid == gid and set(group.gr_mem) <= {user.pw_name}


CONNECT_FIX = f"{RUNTIME_DIR_FIX}; refusing to connect"


def check_runtime_dir(directory: pathlib.Path) -> None:
    """A client's check of the runtime directory it looks for daemons in, since whoever answers
    there names the slabs the client maps (check_trusted_dir). Nothing to check where it does not
    exist."""
    if os.path.lexists(directory):
        check_trusted_dir(directory, "plant a daemon socket", CONNECT_FIX)


def check_trusted_dir(directory: pathlib.Path, planted: str, fix: str) -> None:
    """Refuses a directory others could put things in: it must be a real directory, ours or root's,
    writable by no one else, with trusted directories above it (check_ancestors). `planted` says
    what a stranger could do there, `fix` what the user should do."""
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid not in (os.geteuid(), 0) \
            or others_can_write(info):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory" \
            if not stat.S_ISDIR(info.st_mode) else f"owned by uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}"
        raise InvalidRequestError(f"{directory} ({what}) is not a directory of ours or root's that only its owner "
                                  f"writes: whoever can write there can {planted}; {fix}")
    check_ancestors(directory, fix)


def check_daemon_socket(path: pathlib.Path) -> None:
    """check_runtime_dir of the socket's directory, and the socket itself: a socket (not a link)
    owned by us or root. Where nothing is at `path`, connecting fails on its own (no daemon)."""
    path = pathlib.Path(path)
    try:
        check_runtime_dir(path.parent)
        info = os.lstat(path)
    except (FileNotFoundError, PermissionError):  # no daemon; another user's private dir: connect says so
        return
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid not in (os.geteuid(), 0):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else \
            "not a socket" if not stat.S_ISSOCK(info.st_mode) else f"owned by uid {info.st_uid}"
        raise InvalidRequestError(f"{path} is {what}, not a daemon socket of ours or root's; remove it, or "
                                  f"{CONNECT_FIX}")


def _make_private(path: pathlib.Path, seen: os.stat_result, fix: str) -> None:
    """chmod 0700 through a descriptor opened without following a symlink, after checking that it
    is still the directory we lstat-ed (not swapped for another since)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidRequestError(f"{path} changed while being checked ({e.strerror}); {fix}") from None
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino, info.st_uid) != (seen.st_dev, seen.st_ino, os.getuid()):
            raise InvalidRequestError(f"{path} was replaced while being checked; {fix}")
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


MAX_SOCKET_PATH = 107
"""The longest path a Unix socket may have (sun_path is 108 bytes with its terminating NUL)."""
SOCKET_TAIL = 40
"""The longest name preload puts below a runtime dir for a socket: a DP replica's
engine-<pid>-<8 hex>/replica-<n>.sock, a snapshot's control socket, the daemons' own."""
DAEMON_SOCKET_TAIL = 24
"""The longest name of a daemon's own sockets below the runtime dir (/session-cuda-NNNN.sock)."""


def check_socket_room(runtime_dir: pathlib.Path, tail: int = SOCKET_TAIL) -> None:
    """Refuses a runtime dir so long that sockets of up to `tail` bytes below it would pass
    MAX_SOCKET_PATH: said at start-up, not when a replica or a snapshot first needs its socket."""
    length = len(os.fsencode(str(runtime_dir)))
    if length + tail > MAX_SOCKET_PATH:
        raise InvalidRequestError(f"the runtime directory {runtime_dir} is {length} bytes long: the sockets below it "
                                  f"need up to {tail} more, past the {MAX_SOCKET_PATH}-byte limit of a Unix "
                                  f"socket's path; set PRELOAD_RUNTIME_DIR to a directory at most "
                                  f"{MAX_SOCKET_PATH - tail} bytes long")


def socket_path(runtime_dir: pathlib.Path, device: str) -> pathlib.Path:
    return runtime_dir / f"daemon-{device.replace(':', '-')}.sock"


def lock_path(runtime_dir: pathlib.Path, device: str) -> pathlib.Path:
    """The file a daemon holds locked while it runs (one daemon per device and runtime dir)."""
    return runtime_dir / f"daemon-{device.replace(':', '-')}.lock"


def socket_abandoned(path: pathlib.Path) -> bool:
    """Whether the Unix socket at `path` is one a dead daemon left behind: nothing listens on it, so
    connecting is refused. A daemon that is stopped or hung still has the kernel accept for it."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return False
    except ConnectionRefusedError:
        return True
    except OSError:  # timed out (a full backlog), or cannot tell: not abandoned
        return False
    finally:
        probe.close()


_ROUTER_DIR = re.compile(r"engine-([0-9]{1,9})-[0-9a-f]{8}")  # a data-parallel router's: engine-PID-HEX


def remove_dead_routers_dirs(runtime_dir: pathlib.Path) -> None:
    """Removes the replica socket directories that data-parallel routers killed with SIGKILL left
    (their exit never ran): engine-PID-HEX, its process gone, holding nothing but Unix sockets that
    no one listens on. Anything else in one keeps it, as does a live process of that pid."""
    try:
        entries = [(e, int(found[1])) for e in os.scandir(runtime_dir)
                   if (found := _ROUTER_DIR.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for entry, pid in entries:
        try:
            os.kill(pid, 0)
            continue  # alive (or another user's process of that pid): kept
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            sockets = list(os.scandir(entry.path))
            if all(stat.S_ISSOCK(s.stat(follow_symlinks=False).st_mode) and socket_abandoned(pathlib.Path(s.path))
                   for s in sockets):
                for s in sockets:
                    os.unlink(s.path)
                os.rmdir(entry.path)
                log.info("removed %s, the replica sockets of a router that is gone", entry.path)
        except OSError as e:  # raced with another cleaner, or not ours: left as it is
            log.debug("left %s: %s", entry.path, e)


SHM_RECORD = "shm-dir"
_SHM_NAME = re.compile(r"preload-[0-9a-f]{16}")
_SHM_RECORD_MAX_BYTES = 64


def shm_dir_for(runtime_dir: pathlib.Path, shm_root: pathlib.Path = pathlib.Path("/dev/shm")) -> pathlib.Path:
    """The private slab directory of one runtime dir, shared by all of its daemons. Its name is
    random (shm_root/preload-<16 hex digits>), so no stranger can plant something at it before it
    exists, and is recorded in runtime_dir/shm-dir; it is made anew, and the record rewritten, when
    it has vanished (after a reboot, or when the last daemon removed it empty). Creates runtime_dir
    (0700) if needed. Daemons starting at once take turns on a lock, so they all get the same one."""
    runtime_dir = ensure_private_dir(pathlib.Path(runtime_dir))
    fix = (f"delete {runtime_dir / SHM_RECORD} so that the next daemon makes a new shared-memory directory, "
           f"or {RUNTIME_DIR_FIX}")
    dir_fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)  # released by close
        name = _read_shm_record(runtime_dir, dir_fd)
        if name is not None:
            try:
                return check_private_dir(shm_root / name, fix)
            except FileNotFoundError:
                log.info("%s is gone (reboot?); making a new shared-memory directory", shm_root / name)
            except InvalidRequestError as e:  # someone took the name while it did not exist: not ours
                log.warning("%s; making a new shared-memory directory instead", e)
        path = _make_shm_dir(shm_root, fix)
        _write_shm_record(dir_fd, path.name)
        return path
    finally:
        os.close(dir_fd)


def _read_shm_record(runtime_dir: pathlib.Path, dir_fd: int) -> str | None:
    """The directory name in runtime_dir/shm-dir, or None if there is none or it holds something
    else than a name we write (a torn write after a crash, say: then a new directory is made and the
    record replaced). Anything but a regular file there was put by hand, so it is refused."""
    record = runtime_dir / SHM_RECORD
    try:
        fd = os.open(SHM_RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        raise InvalidRequestError(f"cannot read {record} ({e.strerror}); it should be a small file that "
                                  "preload writes: delete it") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequestError(f"{record} is not a regular file; it should be a small file that preload "
                                      "writes: delete it")
        data = os.read(fd, _SHM_RECORD_MAX_BYTES + 1)
    finally:
        os.close(fd)
    name = data.decode("ascii", "replace").strip()
    if len(data) > _SHM_RECORD_MAX_BYTES or not _SHM_NAME.fullmatch(name):
        log.warning("%s holds %r, not a directory name preload writes; replacing it with a new one", record, data[:40])
        return None
    return name


def _make_shm_dir(shm_root: pathlib.Path, fix: str) -> pathlib.Path:
    """A new 0700 directory with a random name under shm_root."""
    while True:
        path = shm_root / f"preload-{secrets.token_hex(8)}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # 64 random bits: only if someone guessed it
            continue
        except OSError as e:
            raise InvalidRequestError(f"cannot create a shared-memory directory in {shm_root} ({e.strerror}); "
                                      "check that it exists and is writable (is /dev/shm mounted?)") from None
        return check_private_dir(path, fix)


def _write_shm_record(dir_fd: int, name: str) -> None:
    """Replaces the record atomically (a temporary file renamed over it): a reader sees the old name
    or the new one, never a partial one."""
    temp = f".{SHM_RECORD}-{secrets.token_hex(4)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, f"{name}\n".encode())
    finally:
        os.close(fd)
    os.replace(temp, SHM_RECORD, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
