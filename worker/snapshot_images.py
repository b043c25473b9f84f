"""A snapshot's CRIU images on disk: the page images stored zstd-compressed (a process with torch
imported is mostly allocator and interpreter structures, which pack about 6x), and the unpacked
copy a host restores from, made once per host and snapshot (worker/snapshot.py)."""

import hashlib
import os
import pathlib
import secrets
import shutil
import time

from worker import control
from worker.criu import SnapshotError

IMAGES = "images"
ZST = ".zst"
TRIM_AFTER_S = 120.0
STALE_TMP_S = 3600.0
UNPACKED_KEEP = 4
SOURCE = ".source"  # in an unpacked copy: its snapshot's directory


def image_bytes(images: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in images.iterdir() if f.is_file() and ".img" in f.name)


def pack(images: pathlib.Path, raw: pathlib.Path) -> list[str]:
    """Compresses CRIU's page images (zstd): the process's memory, which is mostly the allocator's
    and the interpreter's structures, packs about 5x. The unpacked files move to `raw` (the seed of
    this host's unpacked copy). Each frame records its size and a checksum, which unpacking checks;
    every image is left readable by its owner alone. Returns the packed files."""
    import zstandard
    raw.mkdir(mode=0o700)
    packed = []
    for path in sorted(images.glob("pages-*.img")):
        target = path.with_name(path.name + ZST)
        with open(path, "rb") as src, open(target, "wb") as dst:
            zstandard.ZstdCompressor(level=3, threads=-1, write_checksum=True).copy_stream(
                src, dst, size=path.stat().st_size)
            dst.flush()
            os.fsync(dst.fileno())
        os.rename(path, raw / path.name)
        packed.append(target.name)
    for f in images.iterdir():  # restore refuses images others may write, whatever the umask made them
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o600)
    return packed


def _cache_name(directory: pathlib.Path) -> str:
    """The unpacked copy's name for the snapshot's images as they are now (their path and identity)."""
    images = directory / IMAGES
    identity = [str(directory)] + [f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
                                   for f in sorted(images.iterdir()) for st in [f.stat()]]
    return f"unpacked-{hashlib.sha256(repr(identity).encode()).hexdigest()[:16]}"


def cache_path(directory: pathlib.Path, runtime: pathlib.Path) -> pathlib.Path:
    """Where this host keeps the unpacked copy of the snapshot's images."""
    return control.control_dir(runtime) / _cache_name(directory)


def _stamp(copy: pathlib.Path, directory: pathlib.Path) -> None:
    """Marks a copy whole, naming its snapshot (trim drops the copies of snapshots deleted or replaced)."""
    (copy / SOURCE).write_text(str(directory))
    (copy / ".complete").touch()


def _orphaned(copy: pathlib.Path) -> bool:
    """Whether the snapshot a copy was unpacked from is gone, or holds other images now."""
    try:
        directory = pathlib.Path((copy / SOURCE).read_text())
    except (OSError, ValueError):  # no record: kept as long as the newest
        return False
    try:
        return _cache_name(directory) != copy.name
    except OSError:
        return True


def seed_unpacked(directory: pathlib.Path, images: pathlib.Path, raw: pathlib.Path, runtime: pathlib.Path) -> None:
    """The creating host's unpacked copy, from the files just packed (so that its first restore
    does not unpack); dropped where the runtime directory is on another file system."""
    try:
        for f in images.iterdir():
            if not f.name.endswith(ZST):
                shutil.copyfile(f, raw / f.name)
        _stamp(raw, directory)
        os.rename(raw, cache := cache_path(directory, runtime))
    except OSError:
        shutil.rmtree(raw, ignore_errors=True)
        return
    trim(cache.parent, keep=cache)  # creates add copies too (each about the engine's memory)


def unpacked(directory: pathlib.Path, manifest: dict, runtime: pathlib.Path) -> pathlib.Path:
    """A directory of the snapshot's images as CRIU reads them: the images themselves when nothing
    is packed, else an unpacked copy, made by create or this host's first restore of the snapshot
    and reused by later ones (the newest UNPACKED_KEEP stay, while their snapshots do;
    RUNTIME/snapshots/unpacked-* may be removed at any time)."""
    images = directory / IMAGES
    if not manifest["image"].get("packed"):
        return images
    cache = cache_path(directory, runtime)
    if (cache / ".complete").exists():
        expected = manifest["image"].get("unpacked_bytes")
        if not isinstance(expected, int) or image_bytes(cache) == expected:
            os.utime(cache)
            return cache
        # A file of it truncated or removed (by hand: the cache may be cleared at any time) made
        # restores wait out their timeout, or fail in CRIU: it is unpacked again.
        shutil.rmtree(cache, ignore_errors=True)
    tmp = cache.with_name(f"{cache.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir(mode=0o700)
    try:
        for f in images.iterdir():
            if f.name.endswith(ZST):
                _unpack(f, tmp / f.name.removesuffix(ZST))
            elif f.is_file() and not f.is_symlink():
                shutil.copyfile(f, tmp / f.name)
        _stamp(tmp, directory)
        os.rename(tmp, cache)
    except (OSError, SnapshotError):
        shutil.rmtree(tmp, ignore_errors=True)
        if not (cache / ".complete").exists():  # not another restore that unpacked it first
            raise
    trim(cache.parent, keep=cache)
    return cache


def _unpack(packed: pathlib.Path, target: pathlib.Path) -> None:
    """One page image unpacked, whole: its zstd frame records the size it was packed from (a
    truncated frame unpacks without an error, short, and CRIU then waits for pages that never come)."""
    import zstandard
    fix = "the snapshot's images are damaged; take a new snapshot"
    try:
        with open(packed, "rb") as src, open(target, "wb") as dst:
            expected = zstandard.frame_content_size(src.read(18))
            src.seek(0)
            _, written = zstandard.ZstdDecompressor().copy_stream(src, dst)
    except zstandard.ZstdError as e:
        raise SnapshotError(f"{packed} does not unpack ({e}); {fix}") from None
    if expected < 0 or written != expected:
        raise SnapshotError(f"{packed} unpacks to {written} bytes, its frame says {expected}; {fix}")


def trim(parent: pathlib.Path, keep: pathlib.Path) -> None:
    """Removes the unpacked copies of snapshots deleted or replaced since, and all but the newest
    UNPACKED_KEEP; never `keep`, one still being unpacked (.tmp-), or one used in the last
    TRIM_AFTER_S (another restore may be reading it)."""
    now, done = time.time(), []
    for path in parent.glob("unpacked-*"):
        try:
            mtime = path.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        if ".tmp-" in path.name:  # a restore that died unpacking (one at work writes within seconds)
            if now - mtime > STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
        elif path != keep:
            done.append((mtime, path))
    done.sort(reverse=True)
    for i, (mtime, old) in enumerate(done):
        if now - mtime > TRIM_AFTER_S and (i >= UNPACKED_KEEP - 1 or _orphaned(old)):
            shutil.rmtree(old, ignore_errors=True)
