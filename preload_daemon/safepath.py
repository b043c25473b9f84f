"""A checkpoint's files are input: opening them safely (regular files only, no NUL in a path, no
leaving the directory through a symlink or a '..' in a name) and quoting what they hold in
messages, cut short."""

import os
import pathlib
import stat

from preload_daemon.errors import CheckpointError

EXTERNAL_FIX = ("copy the file into the directory, or, if the link is meant (a Hugging Face cache snapshot links "
                "into ../../blobs), pass --allow-external-links to `preload daemon`/`preload serve`")
_SPECIAL = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
            (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_name_problem(file) -> str:
    """What is wrong with an index entry as the name of a file in the index's directory, or ""."""
    if not isinstance(file, str) or file in ("", ".", ".."):
        return "is not a file name"
    if "\0" in file:
        return "contains a NUL byte"
    if file.startswith("/"):
        return "is an absolute path; an index may only name files in its own directory"
    if ".." in file.split("/"):
        return "leaves the checkpoint directory with '..'; an index may only name files in its own directory"
    if "/" in file:
        return "is a path, not a file name; an index may only name files in its own directory"
    return ""


def inside(root: pathlib.Path, path: pathlib.Path, allow_external: bool) -> pathlib.Path:
    """`path` (in `root`, a resolved directory), refused if a symlink takes it outside `root` and the
    caller does not allow that: the daemon would read, and serve to every engine, a file the
    checkpoint directory does not contain (/dev/zero, another user's model, a file being written)."""
    resolved = pathlib.Path(os.path.realpath(path))
    if not allow_external and not resolved.is_relative_to(root):
        raise CheckpointError(f"{path} links to {resolved}, outside the checkpoint directory {root}; {EXTERNAL_FIX}")
    return path


def open_regular(path: pathlib.Path, missing_fix: str,
                 within: pathlib.Path | None = None) -> tuple[int, os.stat_result]:
    """A read-only fd on `path` and its fstat. It must be a regular file: reading a FIFO would block
    the loading thread forever, a device like /dev/zero would feed it endless bytes. The open does
    not block (a FIFO's open waits for a writer) and the file opened must be the one checked, not
    one swapped in between. With `within` (a resolved directory: inside's root, where links out of
    it are refused), the file opened must lie in it: a link swapped in after inside() checked the
    path would otherwise take the open elsewhere."""
    check_no_nul(path)
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {missing_fix}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}); {missing_fix}") from None
    for test, kind in _SPECIAL:
        if test(before.st_mode):
            raise CheckpointError(f"{path} is {kind}, not a regular file; a checkpoint's files must be regular "
                                  "files (reading this one would block or never end): replace it with the real file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from None
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} was replaced while it was being opened; retry once the checkpoint is written")
    if within is not None:
        opened = _opened_path(fd, path)
        if not pathlib.Path(opened).is_relative_to(within):
            os.close(fd)
            raise CheckpointError(f"{path} links to {opened}, outside the checkpoint directory {within}; "
                                  f"{EXTERNAL_FIX}")
    os.set_blocking(fd, True)
    return fd, info


def _opened_path(fd: int, path: pathlib.Path) -> str:
    """Where the file open on `fd` lies (what the kernel opened, whatever links were swapped since a
    check): its /proc/self/fd link, or, without /proc, `path` resolved now."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)


def read_regular(path: pathlib.Path, limit: int, missing_fix: str, within: pathlib.Path | None = None) -> bytes:
    """The whole of `path`, a regular file of at most `limit` bytes (see open_regular)."""
    fd, info = open_regular(path, missing_fix, within)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1) if info.st_size <= limit else b""
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    if info.st_size > limit or len(data) > limit:
        most = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
        raise CheckpointError(f"{path} is {max(info.st_size, len(data))} bytes, more than the {most} a "
                              f"{path.name} may be; that is not a real one")
    return data


def check_no_nul(path: str | os.PathLike) -> None:
    if "\0" in os.fspath(path):
        raise CheckpointError(f"{short_repr(os.fspath(path))}: a path cannot contain a NUL byte; pass the checkpoint "
                              "directory's real path")


def short_repr(value) -> str:
    """A value from a checkpoint for a message, cut short: it may be megabytes of JSON, and gRPC
    drops an error whose details pass 16 KiB."""
    return short_text(repr(value))


def short_text(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."
