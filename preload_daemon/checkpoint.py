"""Reading Hugging Face checkpoints: config.json plus one or many *.safetensors files (with an
optional model.safetensors.index.json). Headers are validated before any byte is trusted, tensors
are read lazily with pread, straight to where they go, and each file has an identity for the cache
key. Every file is opened as a regular file inside the checkpoint directory, and every read is
bounded: a checkpoint is input, and a bad one gets an error naming the file and the fix, never a
blocked thread or a traceback."""

import dataclasses
import hashlib
import os
import pathlib
import stat
import struct
import typing

import torch

from preload_daemon.buffers import gc_paused
from preload_daemon.errors import CheckpointError
from preload_daemon.hfconfig import load_json, read_config
from preload_daemon.safepath import (check_no_nul, file_name_problem, inside, open_regular, read_regular, short_repr,
                                     short_text)

MAX_HEADER_BYTES = 100 << 20
INDEX_MAX_BYTES = 64 << 20
INDEX_FILE = "model.safetensors.index.json"
READ_VECTORS = max(1, min(1024, os.sysconf("SC_IOV_MAX")))  # buffers one preadv fills
FIX = "re-export it with safetensors.torch.save_file (or re-download it)"
INDEX_FIX = "fix the index or delete it (without one, every *.safetensors file in the directory is read)"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


@dataclasses.dataclass(frozen=True, slots=True)
class FileIdentity:
    """What identifies one checkpoint file: if any field changes, the file is not the one loaded.

    mtime can be set back by anyone who can write the file (`cp -p`, `rsync -t`, `touch -r`), so
    it is not enough: ctime is set by the kernel on every write, rename, chmod or link and cannot be
    set back from user space, and the device number tells a file from another file system's file
    with the same inode. Not detected: a write by someone who also resets the system clock (root),
    or writes to the block device under the file system."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    header_sha256: str
    ctime_ns: int = 0
    device: int = 0

    @classmethod
    def of(cls, path: str, info: os.stat_result, header_sha256: str) -> "FileIdentity":
        return cls(path, info.st_size, info.st_mtime_ns, info.st_ino, header_sha256, info.st_ctime_ns, info.st_dev)

    def same_file(self, info: os.stat_result) -> bool:
        """Whether a stat of the path shows this very file, unchanged."""
        return (info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns, info.st_dev) == \
            (self.size, self.mtime_ns, self.inode, self.ctime_ns, self.device)

    def differences(self, other: "FileIdentity") -> list[str]:
        """Fields that differ; an empty header hash in `other` (a caller that only stat-ed the file,
        see stat_identity) is not compared."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)
                and not (f.name == "header_sha256" and not other.header_sha256)]


class TensorInfo(typing.NamedTuple):
    """Where one tensor lies in a checkpoint file, and what it holds. A named tuple: immutable, and
    made in a fifth of a frozen dataclass's time (a big model has ~90,000)."""

    name: str
    file: pathlib.Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


@gc_paused()
def read_header(path: pathlib.Path) -> tuple[dict[str, TensorInfo], FileIdentity]:
    """Parses and validates one safetensors header. Raises CheckpointError naming the file and the
    first thing wrong with it."""
    fd, info = open_regular(path, FIX)
    try:
        with os.fdopen(fd, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated: {info.st_size} bytes is too short for a safetensors "
                                      f"header; {FIX}")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte "
                                      f"limit; this is not a safetensors file or it is corrupt; {FIX}")
            if 8 + header_len > info.st_size:
                raise CheckpointError(f"{path}: header length {header_len} runs past the end of the "
                                      f"{info.st_size}-byte file (truncated?); {FIX}")
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    if len(raw) < header_len:
        raise CheckpointError(f"{path}: ends inside its header (truncated while being read?); {FIX}")
    header = load_json(raw, f"{path}: header", FIX)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; {FIX}")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {short_repr(metadata)}; {FIX}")

    data_start = 8 + header_len
    data_len = info.st_size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        # The common case checked inline (a JSON value's type is exactly dict, list, str or int: a
        # bool is no int here); anything else goes to _tensor_info, which names what is wrong.
        dtype, shape, offsets = (entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")) \
            if type(entry) is dict else (None, None, None)
        if type(dtype) is str and type(shape) is list and type(offsets) is list and len(offsets) == 2 \
                and (dtype := SAFETENSORS_DTYPES.get(dtype)) is not None:
            begin, end = offsets
            nbytes = dtype.itemsize
            for d in shape:
                if type(d) is not int or d < 0:
                    break
                nbytes *= d
            else:
                if type(begin) is int and type(end) is int and 0 <= begin <= end <= data_len and nbytes == end - begin:
                    tensors[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, nbytes)
                    spans.append((begin, end, name))
                    continue
        tensors[name] = slow = _tensor_info(path, name, entry, data_start, data_len)  # raises
        spans.append((slow.start - data_start, slow.start - data_start + slow.nbytes, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {short_repr(first)} and {short_repr(second)} overlap in the data "
                                  f"section; {FIX}")
    identity = FileIdentity.of(os.path.realpath(path), info, hashlib.sha256(raw).hexdigest())
    return tensors, identity


def _tensor_info(path: pathlib.Path, name: str, entry, data_start: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {short_repr(name)}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{where}: entry needs dtype, shape and data_offsets; {FIX}")
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: unknown dtype {short_repr(entry['dtype'])}; supported: "
                              f"{', '.join(SAFETENSORS_DTYPES)}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: shape {short_repr(shape)} is not a list of non-negative integers; {FIX}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {short_repr(offsets)} is not a pair of integers; {FIX}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{where}: data_offsets {short_repr(offsets)} fall outside the {data_len}-byte data "
                              f"section (truncated file?); {FIX}")
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes != end - begin:
        size = nbytes if nbytes < 1 << 64 else "over 2**64"  # str() of a 5000-digit int fails
        raise CheckpointError(f"{where}: shape {short_repr(shape)} x {entry['dtype']} is {size} bytes but "
                              f"data_offsets span {end - begin}; {FIX}")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _is_int(value) -> bool:
    """A JSON integer: true and false are ints to Python, not to a header."""
    return isinstance(value, int) and not isinstance(value, bool)


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
        weight_map = read_index(inside(path, index, allow_external))
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


def read_index(index: pathlib.Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> the file holding it). Every file must be a plain file
    name in the index's directory: the map is input, and a path in it could send the daemon anywhere."""
    content = load_json(read_regular(index, INDEX_MAX_BYTES, INDEX_FIX), str(index), INDEX_FIX)
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

    def __init__(self, path: str | os.PathLike, *, allow_external: bool = False):
        self.path = checkpoint_dir(path)
        inside(self.path, self.path / "config.json", allow_external)
        self.config = read_config(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        self.identity: list[FileIdentity] = []
        self._identity_of: dict[pathlib.Path, FileIdentity] = {}
        files, weight_map = _weight_files(self.path, allow_external)
        for file in files:
            tensors, identity = read_header(file)
            twice = sorted(tensors.keys() & self.tensors.keys())
            if twice:
                raise CheckpointError(f"{self.path}: tensor {short_repr(twice[0])} appears in both "
                                      f"{self.tensors[twice[0]].file.name} and {file.name}; {FIX}")
            self.tensors.update(tensors)
            self.identity.append(identity)
            self._identity_of[file] = identity
        if weight_map is not None:
            self._check_index(weight_map)
        self._fds: dict[pathlib.Path, int] = {}

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

    def _preadv(self, file: pathlib.Path, views: list[memoryview], offset: int, first: str) -> None:
        """Fills `views` in turn from `file` at `offset`, whatever the reads return at a time (errors
        name the tensor `first` and how many follow it)."""
        following = len(views) - 1
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = self._open(file)
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
            if file not in self._fds:
                self._fds[file] = self._open(file)

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
