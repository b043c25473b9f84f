"""Publishing from a live process: the tensors of a new version arrive over a client-streaming RPC
(a header naming every tensor, then each tensor's bytes in chunks, tensor after tensor) instead of
from files. The header becomes a checkpoint-shaped table so that the same load plan applies
(sharding, quantization, digests); each tensor is assembled in one scratch buffer and written into
every variant's slab as soon as its last byte arrives, so the daemon holds at most one tensor
beyond the slabs, whatever the model's size. No pickle: names, dtypes and shapes travel as fields."""

import dataclasses
import pathlib

import torch

from preload_daemon.buffers import DTYPES, bytes_tensor
from preload_daemon.errors import InvalidRequestError
from preload_daemon.execute import groups, quantizing, write_group
from preload_daemon.hfconfig import parse_config
from preload_daemon.plan import LoadPlan
from preload_daemon.reader import TensorReader
from preload_daemon.safetensors_file import TensorInfo
from protos import preload_pb2 as pb

MAX_TENSORS = 1_000_000
MAX_NAME = 1024
MAX_DIMS = 8
MAX_TENSOR_BYTES = 1 << 40
MAX_LABEL = 200


class StreamedCheckpoint:
    """A publish header, shaped like a Checkpoint for build_plan: `path` (a label for messages),
    `config` and `tensors` (name -> TensorInfo), no files."""

    identity: tuple = ()

    def __init__(self, header: pb.PublishHeader):
        label = header.label[:MAX_LABEL] or "trainer"
        self.path = f"stream:{label}"
        self.config = parse_config(header.config_json, f"{self.path} config.json")
        if not header.tensors:
            raise InvalidRequestError("the publish header lists no tensors; send a whole state dict")
        if len(header.tensors) > MAX_TENSORS:
            raise InvalidRequestError(f"the publish header lists {len(header.tensors)} tensors; at most "
                                      f"{MAX_TENSORS} are accepted")
        self.tensors: dict[str, TensorInfo] = {}
        self.order: list[TensorInfo] = []
        for t in header.tensors:
            info = _tensor_info(t)
            if info.name in self.tensors:
                raise InvalidRequestError(f"tensor {info.name!r} appears twice in the publish header; send each once "
                                          "(tied weights once)")
            self.tensors[info.name] = info
            self.order.append(info)


def _tensor_info(t: pb.TensorSpec) -> TensorInfo:
    if not t.name or len(t.name) > MAX_NAME or "\0" in t.name:
        raise InvalidRequestError(f"tensor name {t.name[:80]!r} must be 1..{MAX_NAME} characters without NUL")
    dtype = DTYPES.get(t.dtype)
    if dtype is None:
        raise InvalidRequestError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}; known: {', '.join(sorted(DTYPES))}")
    if len(t.shape) > MAX_DIMS or any(d < 0 for d in t.shape):
        raise InvalidRequestError(f"tensor {t.name!r}: shape {list(t.shape)} must have at most {MAX_DIMS} "
                                  "non-negative dimensions")
    nbytes = dtype.itemsize
    for d in t.shape:
        nbytes *= d
    if nbytes > MAX_TENSOR_BYTES:
        raise InvalidRequestError(f"tensor {t.name!r}: {nbytes} bytes is more than one tensor may hold here")
    return TensorInfo(t.name, pathlib.Path(), dtype, tuple(t.shape), 0, nbytes)


@dataclasses.dataclass(slots=True)
class _Target:
    group: tuple
    dest: torch.Tensor


def fill(table: StreamedCheckpoint, targets: list[tuple[LoadPlan, torch.Tensor]], chunks, on_tensor) -> None:
    """Consumes `chunks` (TensorData messages) and writes every plan's entries into its destination
    (a zero-filled slab: padding needs no writing). Raises InvalidRequestError on a chunk out of
    order, a tensor that overflows or a stream that ends early."""
    with quantizing([plan for plan, _ in targets]):
        _fill(table, targets, chunks, on_tensor)


def _fill(table: StreamedCheckpoint, targets: list[tuple[LoadPlan, torch.Tensor]], chunks, on_tensor) -> None:
    by_source: dict[str, list[_Target]] = {}
    for plan, dest in targets:
        for group in groups(plan):
            by_source.setdefault(group[0].source, []).append(_Target(group, dest))
    scratch = torch.empty(0, dtype=torch.uint8)
    index, received = 0, 0

    def finish_empty() -> None:
        nonlocal index
        while index < len(table.order) and table.order[index].nbytes == 0:
            _write(table.order[index], torch.empty(0, dtype=torch.uint8), by_source)
            on_tensor(table.order[index])
            index += 1

    finish_empty()
    for chunk in chunks:
        if index >= len(table.order):
            raise InvalidRequestError(f"data after the last of {len(table.order)} tensors; send each tensor once")
        info = table.order[index]
        if chunk.index != index or chunk.offset != received:
            raise InvalidRequestError(f"chunk for tensor #{chunk.index} at byte {chunk.offset}, expected tensor "
                                      f"#{index} ({info.name!r}) at byte {received}: send tensors in header order, "
                                      "each one's bytes in order")
        if received + len(chunk.data) > info.nbytes:
            raise InvalidRequestError(f"tensor {info.name!r} gets more than its {info.nbytes} bytes "
                                      f"({list(info.shape)} x {info.dtype})")
        if received == 0 and scratch.numel() < info.nbytes:
            scratch = torch.empty(info.nbytes, dtype=torch.uint8)
        if chunk.data:
            scratch[received:received + len(chunk.data)] = bytes_tensor(chunk.data)
        received += len(chunk.data)
        if received == info.nbytes:
            _write(info, scratch[:info.nbytes], by_source)
            on_tensor(info)
            index, received = index + 1, 0
            finish_empty()
    if index < len(table.order):
        raise InvalidRequestError(f"the stream ended after {index} of {len(table.order)} tensors (at "
                                  f"{table.order[index].name!r}); nothing was published")


def _write(info: TensorInfo, raw: torch.Tensor, by_source: dict[str, list[_Target]]) -> None:
    targets = by_source.get(info.name, ())
    if not targets:
        return
    tensor = raw.view(info.dtype).view(info.shape) if info.nbytes else torch.empty(info.shape, dtype=info.dtype)
    reader = TensorReader({info.name: tensor})
    for target in targets:
        write_group(reader, target.group, target.dest)
