"""Reading Hugging Face checkpoints: config.json plus one or many *.safetensors files (with an
optional model.safetensors.index.json). Headers are validated before any byte is trusted, tensors
are read lazily with pread, straight to where they go, and each file has an identity for the cache
key."""

import dataclasses
import hashlib
import json
import os
import pathlib
import struct

import torch

from preload_daemon.arch import read_config
from preload_daemon.errors import CheckpointError

MAX_HEADER_BYTES = 100 << 20
INDEX_FILE = "model.safetensors.index.json"
FIX = "re-export it with safetensors.torch.save_file (or re-download it)"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


@dataclasses.dataclass(frozen=True, slots=True)
class FileIdentity:
    """What identifies one checkpoint file: if any field changes, the file is not the one loaded."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    header_sha256: str

    def differences(self, other: "FileIdentity") -> list[str]:
        """Fields that differ; an empty header hash in `other` (a caller that only stat-ed the file,
        see stat_identity) is not compared."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)
                and not (f.name == "header_sha256" and not other.header_sha256)]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    file: pathlib.Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


def read_header(path: pathlib.Path) -> tuple[dict[str, TensorInfo], FileIdentity]:
    """Parses and validates one safetensors header. Raises CheckpointError naming the file and the
    first thing wrong with it."""
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
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
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}); {FIX}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; {FIX}")

    data_start = 8 + header_len
    data_len = info.st_size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, entry, data_start, data_len)
        spans.append((tensors[name].start, tensors[name].start + tensors[name].nbytes, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap in the data section; {FIX}")
    identity = FileIdentity(str(path.resolve()), info.st_size, info.st_mtime_ns, info.st_ino,
                            hashlib.sha256(raw).hexdigest())
    return tensors, identity


def _tensor_info(path: pathlib.Path, name: str, entry, data_start: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{where}: entry needs dtype, shape and data_offsets; {FIX}")
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"{where}: unknown dtype {entry['dtype']!r}; supported: "
                              f"{', '.join(SAFETENSORS_DTYPES)}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers; {FIX}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers; {FIX}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] fall outside the {data_len}-byte data "
                              f"section (truncated file?); {FIX}")
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != end - begin:
        raise CheckpointError(f"{where}: shape {shape} x {entry['dtype']} is {numel * dtype.itemsize} bytes but "
                              f"data_offsets span {end - begin}; {FIX}")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def refresh_identity(files: tuple[FileIdentity, ...]) -> tuple[FileIdentity, ...]:
    """The identity of the same files as they are on disk now. A stat is enough when size, mtime and
    inode are unchanged; only a file that changed has its header read again."""
    fresh = []
    for ident in files:
        try:
            info = os.stat(ident.path)
        except OSError:
            fresh.append(FileIdentity(ident.path, 0, 0, 0, "missing"))
            continue
        if (info.st_size, info.st_mtime_ns, info.st_ino) == (ident.size, ident.mtime_ns, ident.inode):
            fresh.append(ident)
        else:
            try:
                fresh.append(read_header(pathlib.Path(ident.path))[1])
            except CheckpointError:
                fresh.append(FileIdentity(ident.path, info.st_size, info.st_mtime_ns, info.st_ino, "unreadable"))
    return tuple(fresh)


def stat_identity(directory: str | os.PathLike) -> tuple[FileIdentity, ...]:
    """The identity of a checkpoint's weight files from one stat each, without reading them: what an
    engine sends the daemon to say which files it was started on (the header hash is left empty)."""
    path = pathlib.Path(directory).resolve()
    identity = []
    for file in weight_files(path):
        try:
            info = os.stat(file)
        except OSError as e:
            raise CheckpointError(f"{file}: cannot stat ({e})") from e
        identity.append(FileIdentity(str(file.resolve()), info.st_size, info.st_mtime_ns, info.st_ino, ""))
    return tuple(identity)


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The *.safetensors files of a checkpoint directory: those its index names, else all of them."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass a Hugging Face checkpoint directory "
                              "(config.json plus *.safetensors)")
    index = path / INDEX_FILE
    if index.exists():
        weight_map = read_index(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names files that do not exist: {', '.join(missing)}; "
                                  "copy the whole checkpoint directory")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files; convert the weights to safetensors first")
    return files


def read_index(index: pathlib.Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: cannot read its weight_map ({e}); fix or delete the index") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is not an object")
    return weight_map


class Checkpoint:
    """A checkpoint directory, opened lazily: headers now, bytes only when a tensor is read."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path).resolve()
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory; pass a Hugging Face checkpoint directory "
                                  "(config.json plus *.safetensors)")
        self.config = read_config(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        self.identity: list[FileIdentity] = []
        for file in weight_files(self.path):
            tensors, identity = read_header(file)
            twice = sorted(tensors.keys() & self.tensors.keys())
            if twice:
                raise CheckpointError(f"{self.path}: tensor {twice[0]!r} appears in both "
                                      f"{self.tensors[twice[0]].file.name} and {file.name}; {FIX}")
            self.tensors.update(tensors)
            self.identity.append(identity)
        self._check_index()
        self._fds: dict[pathlib.Path, int] = {}

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        if not archs:
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

    def read_into(self, name: str, out: torch.Tensor, skip: int = 0) -> None:
        """Reads the stored bytes of `name`, from byte `skip` on, straight into `out` (a contiguous
        uint8 tensor) with pread: one copy from the page cache, no mapping, no page faults."""
        info = self.tensors[name]
        if skip + out.numel() > info.nbytes:
            raise ValueError(f"{name}: {out.numel()} bytes from {skip} run past its {info.nbytes} bytes")
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY | os.O_CLOEXEC)
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], info.start + skip + done)
            if n == 0:
                raise CheckpointError(f"{info.file}: ends early while reading {name!r}; the file was truncated "
                                      f"after it was opened; {FIX}")
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _check_index(self) -> None:
        index = self.path / INDEX_FILE
        if not index.exists():
            return
        for name, file in read_index(index).items():
            info = self.tensors.get(name)
            if info is None or info.file.name != file:
                raise CheckpointError(f"{index} places tensor {name!r} in {file}, but that file does not hold "
                                      "it; regenerate the index")
