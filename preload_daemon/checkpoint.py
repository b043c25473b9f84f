"""Reading Hugging Face checkpoints: config.json plus one or many *.safetensors files (with an
optional model.safetensors.index.json). Each file's header is validated before any byte is trusted
(safetensors_file.py), tensors are read lazily with pread, straight to where they go, and each file
has an identity for the cache key. Every file is opened as a regular file inside the checkpoint directory, and every read is
bounded: a checkpoint is input, and a bad one gets an error naming the file and the fix, never a
blocked thread or a traceback."""

import os
import pathlib
import stat
import threading

import torch

from preload_daemon.errors import CheckpointError
from preload_daemon.hfconfig import load_json, read_config
from preload_daemon.safepath import (check_no_nul, file_name_problem, inside, open_regular, read_regular, short_repr,
                                     short_text)
from preload_daemon.safetensors_file import FIX, FileIdentity, TensorInfo, read_header

INDEX_MAX_BYTES = 64 << 20
INDEX_FILE = "model.safetensors.index.json"
READ_VECTORS = max(1, min(1024, os.sysconf("SC_IOV_MAX")))  # buffers one preadv fills
READ_AHEAD_WINDOW = 8 << 20  # bytes one POSIX_FADV_WILLNEED asks for (the kernel reads at most its readahead size)
# Bytes read ahead in all: what a disk reads while the largest plans are made (90,000 tensors: about a
# second), and a bound on a hint's cost (a sparse file of a terabyte "reads" as fast as memory fills).
READ_AHEAD_MAX = 4 << 30
INDEX_FIX = "fix the index or delete it (without one, every *.safetensors file in the directory is read)"


def _named(first: str, following: int) -> str:
    """A run of tensors in an error message (built only then, not on every read)."""
    return short_repr(first) + (f" and the {following} tensors after it" if following else "")


def refresh_identity(files: tuple[FileIdentity, ...]) -> tuple[FileIdentity, ...]:
    """The identity of the same files as they are on disk now. A stat is enough when the file is
    unchanged (FileIdentity.same_file); only a file that changed has its header read again."""
    fresh = []
    for ident in files:
        try:
            info = os.stat(ident.path)
        except OSError:
            fresh.append(FileIdentity(ident.path, 0, 0, 0, "missing"))
            continue
        if ident.same_file(info):
            fresh.append(ident)
        else:
            try:
                fresh.append(read_header(pathlib.Path(ident.path))[1])
            except CheckpointError:
                fresh.append(FileIdentity.of(ident.path, info, "unreadable"))
    return tuple(fresh)


def stat_identity(directory: str | os.PathLike, *, allow_external: bool = False) -> tuple[FileIdentity, ...]:
    """The identity of a checkpoint's weight files from one stat each, without reading them: what an
    engine sends the daemon to say which files it was started on (the header hash is left empty)."""
    path = checkpoint_dir(directory)
    identity = []
    for file in weight_files(path, allow_external=allow_external):
        try:
            info = os.stat(file)
        except OSError as e:
            raise CheckpointError(f"{file}: cannot stat ({e})") from e
        identity.append(FileIdentity.of(os.path.realpath(file), info, ""))
    return tuple(identity)


def checkpoint_dir(directory: str | os.PathLike) -> pathlib.Path:
    """`directory` resolved: the root every file of the checkpoint must lie in."""
    check_no_nul(directory)
    path = pathlib.Path(os.path.realpath(directory))  # not Path.resolve: it raises on a symlink loop
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    except OSError as e:
        raise CheckpointError(f"{short_repr(str(path))}: cannot open ({e.strerror or e}); pass a Hugging Face "
                              "checkpoint directory") from None
    if not is_dir:
        raise CheckpointError(f"{path}: not a directory; pass a Hugging Face checkpoint directory "
                              "(config.json plus *.safetensors)")
    return path


def weight_files(path: pathlib.Path, *, allow_external: bool = False) -> list[pathlib.Path]:
    """The *.safetensors files of a checkpoint directory (see checkpoint_dir): those its index names,
    else all of them. Each must lie inside the directory unless `allow_external`."""
    return _weight_files(path, allow_external)[0]


def _weight_files(path: pathlib.Path, allow_external: bool) -> tuple[list[pathlib.Path], dict[str, str] | None]:
    """weight_files, and the index's weight_map (None without an index)."""
    index = path / INDEX_FILE
    if os.path.lexists(index):
        weight_map = read_index(inside(path, index, allow_external), None if allow_external else path)
        files = [inside(path, path / name, allow_external) for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not os.path.exists(f)]
        if missing:
            raise CheckpointError(f"{index} names files that do not exist: "
                                  f"{', '.join(map(short_text, missing[:5]))}; copy the whole checkpoint directory")
        return files, weight_map
    files = [inside(path, f, allow_external) for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files; convert the weights to safetensors first")
    return files, None


def read_index(index: pathlib.Path, within: pathlib.Path | None = None) -> dict[str, str]:
    """The index's weight_map (tensor name -> the file holding it). Every file must be a plain file
    name in the index's directory: the map is input, and a path in it could send the daemon anywhere."""
    content = load_json(read_regular(index, INDEX_MAX_BYTES, INDEX_FIX, within), str(index), INDEX_FIX)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no weight_map object (tensor name -> file name); {INDEX_FIX}")
    values = weight_map.values()
    if all(type(file) is str for file in values) and not any(map(file_name_problem, set(values))):
        return weight_map  # each distinct file name checked once (a big model has a few, for 90,000 tensors)
    for name, file in weight_map.items():
        problem = file_name_problem(file)
        if problem:
            raise CheckpointError(f"{index}: weight_map[{short_repr(name)}] = {short_repr(file)} {problem}; "
                                  f"{INDEX_FIX}")
    return weight_map


class Checkpoint:
    """A checkpoint directory, opened lazily: headers now, bytes only when a tensor is read. Every
    file must lie inside the directory unless `allow_external` (see inside)."""

    def __init__(self, path: str | os.PathLike, *, allow_external: bool = False, read_ahead: bool = False):
        """`read_ahead`: a load that will read (about) every byte of every file says so, and the
        disk starts on them now, while the headers are checked and the plan is made (ReadAhead)."""
        self.path = checkpoint_dir(path)
        within = None if allow_external else self.path  # and each file opened must lie there (open_regular)
        inside(self.path, self.path / "config.json", allow_external)
        self.config = read_config(self.path, within)
        self.tensors: dict[str, TensorInfo] = {}
        self.identity: list[FileIdentity] = []
        self._identity_of: dict[pathlib.Path, FileIdentity] = {}
        self._fds: dict[pathlib.Path, int] = {}
        files, weight_map = _weight_files(self.path, allow_external)
        self.read_ahead = ReadAhead(files, within) if read_ahead else None
        try:
            for file in files:
                tensors, identity = read_header(file, within)
                twice = sorted(tensors.keys() & self.tensors.keys())
                if twice:
                    raise CheckpointError(f"{self.path}: tensor {short_repr(twice[0])} appears in both "
                                          f"{self.tensors[twice[0]].file.name} and {file.name}; {FIX}")
                self.tensors.update(tensors)
                self.identity.append(identity)
                self._identity_of[file] = identity
            if weight_map is not None:
                self._check_index(weight_map)
        except BaseException:
            self.close()
            raise

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise CheckpointError(f"{self.path}/config.json has no 'architectures' entry; add the model class, "
                                  "e.g. \"architectures\": [\"LlamaForCausalLM\"]")
        return archs[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str) -> torch.Tensor:
        """A private copy of one tensor as stored."""
        info = self.tensors[name]
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        self.read_into(name, out)
        return out.view(info.dtype).view(info.shape) if info.nbytes else torch.empty(info.shape, dtype=info.dtype)

    def read_into(self, name: str, out: torch.Tensor | memoryview, skip: int = 0) -> None:
        """Reads the stored bytes of `name`, from byte `skip` on, straight into `out` (a contiguous
        uint8 tensor, or a byte memoryview) with pread: one copy from the page cache, no mapping."""
        view = memoryview(out.numpy()).cast("B") if isinstance(out, torch.Tensor) else out
        self.read_many([(name, view, skip)])

    def read_many(self, reads: list[tuple[str, memoryview, int]]) -> None:
        """read_into for each (name, byte view, skip) in turn, every one checked before any is read;
        reads that continue one another in the same file (tensors stored back to back, in order) go
        as one preadv of up to READ_VECTORS buffers: one system call, not one a tensor, for runs of
        small tensors."""
        infos = [self.tensors[name] for name, _, _ in reads]
        for info, (name, view, skip) in zip(infos, reads):
            if skip < 0 or skip + len(view) > info.nbytes:
                raise ValueError(f"{name}: {len(view)} bytes from {skip} run past its {info.nbytes} bytes")
        i = 0
        while i < len(reads):
            name, view, skip = reads[i]
            info = infos[i]
            offset, end, views = info.start + skip, info.start + skip + len(view), [view]
            while i + len(views) < len(reads) and len(views) < READ_VECTORS:
                _, next_view, next_skip = reads[i + len(views)]
                following = infos[i + len(views)]
                # One file's tensors share its Path object: `is` first (== takes 0.3 us).
                if (following.file is not info.file and following.file != info.file) \
                        or following.start + next_skip != end:
                    break
                views.append(next_view)
                end += len(next_view)
            self._preadv(info.file, views, offset, name)
            i += len(views)

    def read_strided(self, name: str, out: memoryview, skip: int, width: int, stride: int) -> None:
        """Fills `out` (a byte memoryview of whole pieces) with pieces of `width` bytes of `name`'s stored
        bytes, the first at byte `skip`, each `stride` after the one before: a column shard of a 2-D
        tensor, one piece a row. One pread a piece, in a loop that does nothing else: through
        read_into, the slicing and checks around each piece cost ~19 us, several times its read from
        the page cache (one TP=2 rank of a 1 GB synthetic model, page-cached, 2-core Zen 4: its
        column shards 0.43-0.62 -> 0.12-0.15 s of read time, the whole load 0.38-0.74 -> 0.22-0.30 s)."""
        info = self.tensors[name]
        count = len(out) // width if width > 0 else 0
        if width <= 0 or stride < width or skip < 0 or count * width != len(out) \
                or (count and skip + (count - 1) * stride + width > info.nbytes):
            raise ValueError(f"{name}: {len(out)} bytes in pieces of {width} every {stride} from {skip} do not fit "
                             f"its {info.nbytes} bytes")
        fd, pread, offset = self._fd(info.file), os.preadv, info.start + skip
        for at in range(0, len(out), width):
            piece = out[at:at + width]
            try:
                done = pread(fd, (piece,), offset)
            except OSError:
                done = 0  # _preadv names the error
            if done != width:  # a short read: the general path retries it, or says why it cannot
                self._preadv(info.file, [piece], offset, name)
            offset += stride

    def _preadv(self, file: pathlib.Path, views: list[memoryview], offset: int, first: str) -> None:
        """Fills `views` in turn from `file` at `offset`, whatever the reads return at a time (errors
        name the tensor `first` and how many follow it)."""
        following = len(views) - 1
        fd = self._fd(file)
        views, k = [v for v in views if len(v)], 0
        while k < len(views):
            try:
                n = os.preadv(fd, views[k:] if k else views, offset)
            except OSError as e:
                raise CheckpointError(f"{file}: reading {_named(first, following)} failed ({e.strerror or e})") from e
            if n == 0:
                raise CheckpointError(f"{file}: ends early while reading {_named(first, following)}; the file was "
                                      f"truncated after it was opened; {FIX}")
            offset += n
            while k < len(views) and n >= len(views[k]):
                n -= len(views[k])
                k += 1
            if n:
                views[k] = views[k][n:]

    def open_files(self) -> None:
        """Opens every weight file now (read_into opens them on first use), so that threads reading
        at once share one descriptor per file."""
        for file in self._identity_of:
            self._fd(file)

    def _fd(self, file: pathlib.Path) -> int:
        """The descriptor reads of `file` share, opened (and checked, _open) on first use."""
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = self._open(file)
        return fd

    def _open(self, file: pathlib.Path) -> int:
        """An fd on `file`, which must still be the file whose header was read: one replaced or
        rewritten since would put other bytes under the same identity."""
        fd, info = open_regular(file, FIX)
        ident = self._identity_of[file]
        if not ident.same_file(info):
            os.close(fd)
            raise CheckpointError(f"{file} changed after its header was read (rewritten while loading?); load the "
                                  "checkpoint again once it is written")
        return fd

    def close(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.stop()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _check_index(self, weight_map: dict[str, str]) -> None:
        index = self.path / INDEX_FILE
        tensors = self.tensors
        file_names = {file: file.name for file in self._identity_of}  # Path.name costs a microsecond or so
        for name, file in weight_map.items():
            info = tensors.get(name)
            if info is None or file_names[info.file] != file:
                raise CheckpointError(f"{index} places tensor {short_repr(name)} in {file}, but that file does not "
                                      "hold it; regenerate the index")


class ReadAhead:
    """Asks the kernel to read checkpoint files into the page cache, in order, READ_AHEAD_WINDOW at a
    time (POSIX_FADV_WILLNEED: no copy, and the pages need no reading again), on a thread of its own
    until the files end, READ_AHEAD_MAX is asked for, or stop() (a load's reads begin, the checkpoint
    is closed). A load of many small tensors spends a while in Python before its first read (20,000
    of them: 130-170 ms to check the headers and make the plan), in which the disk sat idle. Only a
    hint: a file it cannot open (or, given `within`, one that lies outside it: open_regular) is
    skipped, and what it read is read again if evicted meanwhile."""

    def __init__(self, files: list[pathlib.Path], within: pathlib.Path | None = None):
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(files), within), name="read-ahead", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Asks no more of the kernel (the window asked for last still arrives)."""
        self._stopped.set()

    def _run(self, files: list[pathlib.Path], within: pathlib.Path | None) -> None:
        budget = READ_AHEAD_MAX
        for file in files:
            try:
                fd, info = open_regular(file, FIX, within)
            except CheckpointError:
                continue  # the load names what is wrong with it
            try:
                for offset in range(0, info.st_size, READ_AHEAD_WINDOW):
                    if self._stopped.is_set() or budget <= 0:
                        return
                    os.posix_fadvise(fd, offset, READ_AHEAD_WINDOW, os.POSIX_FADV_WILLNEED)
                    budget -= READ_AHEAD_WINDOW
            except OSError:
                continue
            finally:
                os.close(fd)
