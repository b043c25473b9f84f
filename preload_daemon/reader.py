"""Readers of a load plan's source tensors for execute.py: from a checkpoint's files (Reader, through
scratch buffers, a TP rank reading only its shard's bytes), or from tensors already in memory
(TensorReader, e.g. what a trainer streams)."""

import concurrent.futures

import torch

from preload_daemon.checkpoint import Checkpoint
from preload_daemon.plan import PlanEntry


class TensorReader:
    """A reader over tensors already in memory ({name: tensor}), e.g. one streamed by a trainer."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, shard) -> torch.Tensor:
        t = self.tensors[name]
        return t if shard is None else t.narrow(shard.dim, shard.start, shard.length)

    def copy_into(self, entry: PlanEntry, out: torch.Tensor) -> None:
        out.view(entry.dtype).view(entry.shape).copy_(self.read(entry.source, entry.shard))


class Reader:
    """Reads checkpoint tensors (or TP slices of them) through two reusable scratch buffers, which
    only the thread running execute() hands out. Where `upcoming` names the next quantized source, the
    read after it is set starts reading that on the pool into the other buffer, while the caller
    quantizes what it read (read_ahead starts it at once); reading that source then waits for it."""

    def __init__(self, checkpoint: Checkpoint, pool: concurrent.futures.Executor | None = None):
        self.checkpoint, self.pool = checkpoint, pool
        self.scratch = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.upcoming = None  # (name, shard) to read ahead once read() next returns
        self.ahead = None  # (name, shard, scratch index, future) of the read ahead in flight

    def copy_into(self, entry: PlanEntry, out: torch.Tensor) -> None:
        """Writes one planned tensor, converting its dtype if needed, into `out` (its slab bytes)."""
        info = self.checkpoint.tensors[entry.source]
        if in_place(info, entry):  # from the file to its place in one read
            self.checkpoint.read_into(entry.source, out, row_range(info, entry.shard)[1])
            return
        out.view(entry.dtype).view(entry.shape).copy_(self.read(entry.source, entry.shard))

    def read_columns(self, entry: PlanEntry, out: torch.Tensor) -> None:
        """A column shard of a 2-D tensor, one read per row from the file to its place in `out`."""
        self._read_columns(entry.source, entry.shard, memoryview(out.numpy()))

    def _read_columns(self, name: str, shard, out: memoryview) -> None:
        info = self.checkpoint.tensors[name]
        size = info.dtype.itemsize
        if shard.length and info.shape[0]:
            self.checkpoint.read_strided(name, out, shard.start * size, shard.length * size,
                                         info.nbytes // info.shape[0])

    def read(self, name: str, shard) -> torch.Tensor:
        """The stored tensor (or its shard) as a view of a scratch buffer, valid until the next read.
        Only the shard's bytes are read: its rows, or a column shard's piece of each row."""
        ahead = self.ahead
        if ahead is not None and ahead[:2] == (name, shard):
            self.ahead = None
            index, src = ahead[2], ahead[3].result()
        else:  # into the buffer no read ahead is filling
            index = ahead[2] ^ 1 if ahead is not None else 0
            src = self._read(name, shard, index)
        upcoming, self.upcoming = self.upcoming, None
        if upcoming is not None and self.ahead is None and self.pool is not None:
            self._read_ahead(*upcoming, index ^ 1)
        return src

    def read_ahead(self, name: str, shard) -> None:
        """Starts reading `name` (or its shard) on the pool now, unless a read ahead is in flight;
        read() of it then waits for that. Only between read()s, when neither buffer is in use."""
        if self.ahead is None and self.pool is not None:
            self._read_ahead(name, shard, 0)

    def _read_ahead(self, name: str, shard, index: int) -> None:
        self._scratch(index, self.length(name, shard))  # grown here: malloc's arena of this thread
        self.ahead = (name, shard, index, self.pool.submit(self._read, name, shard, index))

    def length(self, name: str, shard) -> int:
        """The bytes read() of `name` (or its shard) reads."""
        info = self.checkpoint.tensors[name]
        if shard is not None and shard.dim == 1 and len(info.shape) == 2:
            return info.shape[0] * shard.length * info.dtype.itemsize
        return row_range(info, shard)[2]

    def _read(self, name: str, shard, index: int) -> torch.Tensor:
        info = self.checkpoint.tensors[name]
        if shard is not None and shard.dim == 1 and len(info.shape) == 2:
            scratch = self._scratch(index, self.length(name, shard))
            self._read_columns(name, shard, memoryview(scratch.numpy()))
            return scratch.view(info.dtype).view(info.shape[0], shard.length)
        rows, skip, length = row_range(info, shard)
        scratch = self._scratch(index, length)
        self.checkpoint.read_into(name, scratch, skip)
        src = scratch.view(info.dtype).view((rows.length, *info.shape[1:]) if rows else info.shape)
        if shard is not None and rows is None:
            src = src.narrow(shard.dim, shard.start, shard.length)
        return src

    def _scratch(self, index: int, length: int) -> torch.Tensor:
        """Scratch buffer `index`'s first `length` bytes, grown to hold them if needed."""
        if self.scratch[index].numel() < length:
            self.scratch[index] = torch.empty(length, dtype=torch.uint8)
        return self.scratch[index][:length]


def in_place(info, entry: PlanEntry) -> bool:
    """Whether a planned tensor is its stored bytes, read straight into place: the same dtype, and
    the whole tensor or whole rows of it (one byte range: row_range). (execute's _run_reads states
    this rule inline.)"""
    return info.dtype == entry.dtype and (entry.shard is None or entry.shard.dim == 0)


def row_range(info, shard):
    """(the shard if it takes whole rows, else None; its first byte; its byte length) within a stored
    tensor: a dim-0 shard is one contiguous byte range, so only those rows need reading."""
    rows = shard if shard is not None and shard.dim == 0 else None
    row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
    if rows is None:
        return None, 0, info.nbytes
    return rows, rows.start * row_bytes, rows.length * row_bytes
