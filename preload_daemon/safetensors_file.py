"""One safetensors file: its header read, bounded and validated before any byte of it is trusted
(the tensors' names, dtypes, shapes and places in the file, none overlapping another), and the
file's identity (FileIdentity), which says whether a file on disk is still the one loaded.
checkpoint.py reads a directory of such files."""

import dataclasses
import hashlib
import os
import pathlib
import struct
import typing

import torch

from preload_daemon.buffers import gc_paused
from preload_daemon.errors import CheckpointError
from preload_daemon.hfconfig import load_json
from preload_daemon.safepath import open_regular, short_repr

MAX_HEADER_BYTES = 100 << 20
FIX = "re-export it with safetensors.torch.save_file (or re-download it)"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}

_ITEMSIZE = {name: (dtype, dtype.itemsize) for name, dtype in SAFETENSORS_DTYPES.items()}


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
def read_header(path: pathlib.Path, within: pathlib.Path | None = None) -> tuple[dict[str, TensorInfo], FileIdentity]:
    """Parses and validates one safetensors header (of a file in `within`, if given: open_regular).
    Raises CheckpointError naming the file and the first thing wrong with it."""
    fd, info = open_regular(path, FIX, within)
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
        # The common case checked inline (a JSON value's type is exactly dict, list, str or int: a
        # bool is no int here); anything else goes to _tensor_info, which names what is wrong.
        try:
            dtype, nbytes = _ITEMSIZE[entry["dtype"]]
            shape = entry["shape"]
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            dtype = None
        if dtype is not None and type(shape) is list and type(begin) is int and type(end) is int:
            for d in shape:
                if type(d) is not int or d < 0:
                    break
                nbytes *= d
            else:
                if 0 <= begin <= end <= data_len and nbytes == end - begin:
                    tensors[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, nbytes)
                    spans.append((begin, end, name))
                    continue
        if name == "__metadata__":  # an object of strings (checked above): no tensor entry
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
