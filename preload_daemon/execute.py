"""Runs a load plan: fills a destination (a shared slab, or private memory on the cold path) with
the plan's tensors in order, reading each checkpoint tensor once and quantizing where planned.
Peak extra memory is one tensor (a layer's largest), never a second copy of the model."""

import torch

from kernels import quant
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError
from preload_daemon.plan import LoadPlan, PlanEntry


def execute(plan: LoadPlan, checkpoint: Checkpoint, dest: torch.Tensor, on_tensor=None, hasher=None) -> None:
    """Fills `dest` (a flat uint8 tensor of plan.total_bytes). `hasher` (hashlib-style) sees every
    byte of dest exactly once, padding included, as it is written; `on_tensor(entry)` is called
    after each slab tensor."""
    if dest.dtype != torch.uint8 or dest.numel() != plan.total_bytes:
        raise ValueError(f"destination must be {plan.total_bytes} uint8 bytes, got {dest.numel()} {dest.dtype}")
    reader = _Reader(checkpoint)
    hashed = 0
    for group, next_offset in groups(plan):
        write_group(reader, group, dest)
        dest[group[-1].offset + group[-1].nbytes:next_offset].zero_()  # padding: fresh memory holds garbage
        if hasher is not None:
            hasher.update(memoryview(dest[hashed:next_offset].numpy()))
            hashed = next_offset
        if on_tensor is not None:
            for entry in group:
                on_tensor(entry)


def groups(plan: LoadPlan) -> list[tuple[list[PlanEntry], int]]:
    """The plan's entries grouped by what one write makes: the parts of one quantized source (they
    follow each other), or one copied tensor; each with the offset where the next group starts."""
    entries, out, i = plan.entries, [], 0
    while i < len(entries):
        group = [entries[i]]
        if entries[i].quantize:
            while i + len(group) < len(entries) and entries[i + len(group)].source == entries[i].source \
                    and entries[i + len(group)].quantize:
                group.append(entries[i + len(group)])
        i += len(group)
        out.append((group, entries[i].offset if i < len(entries) else plan.total_bytes))
    return out


def write_group(reader, group: list[PlanEntry], dest: torch.Tensor) -> None:
    """Writes one group's bytes into `dest`. `reader` has read(name, shard) -> tensor and
    copy_into(entry, out): a checkpoint's files, or the tensor a publishing client just sent."""
    if group[0].quantize:
        _quantize_into(reader, group, dest)
    elif group[0].nbytes:
        reader.copy_into(group[0], dest[group[0].offset:group[0].offset + group[0].nbytes])


class TensorReader:
    """A reader over tensors already in memory ({name: tensor}), e.g. one streamed by a trainer."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, shard) -> torch.Tensor:
        t = self.tensors[name]
        return t if shard is None else t.narrow(shard.dim, shard.start, shard.length)

    def copy_into(self, entry: PlanEntry, out: torch.Tensor) -> None:
        out.view(entry.dtype).view(entry.shape).copy_(self.read(entry.source, entry.shard))


def _quantize_into(reader, group: list[PlanEntry], dest: torch.Tensor) -> None:
    first = group[0]
    try:
        # The whole weight, then this rank's slice: scales that span the slice (per tensor, per row
        # of a row-parallel shard) are the whole weight's, so TP ranks hold exactly TP=1's parts.
        q = quant.quantize(reader.read(first.source, None), first.quant_scheme)
        if first.shard is not None:
            q = quant.narrow(q, first.shard.dim, first.shard.start, first.shard.length)
    except ValueError as e:
        raise CheckpointError(f"cannot quantize {first.source!r} to {first.quant_scheme}: {e}") from e
    parts = {"weight": q.weight, "weight_scale": q.scale, "weight_global_scale": q.global_scale}
    for entry in group:
        out = dest[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
        out.copy_(parts[entry.part].view(entry.shape))


class _Reader:
    """Reads checkpoint tensors (or TP slices of them) through one reusable scratch buffer."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def copy_into(self, entry: PlanEntry, out: torch.Tensor) -> None:
        """Writes one planned tensor, converting its dtype if needed, into `out` (its slab bytes)."""
        info = self.checkpoint.tensors[entry.source]
        rows, skip, _ = _row_range(info, entry.shard)
        if info.dtype == entry.dtype and entry.shard is rows:
            # Same dtype, whole tensor or contiguous rows: from the file to its place in one read.
            self.checkpoint.read_into(entry.source, out, skip)
            return
        out.view(entry.dtype).view(entry.shape).copy_(self.read(entry.source, entry.shard))

    def read(self, name: str, shard) -> torch.Tensor:
        """The stored tensor (or its shard) as a view of the scratch buffer, valid until the next read."""
        info = self.checkpoint.tensors[name]
        rows, skip, length = _row_range(info, shard)
        if self.scratch.numel() < length:
            self.scratch = torch.empty(length, dtype=torch.uint8)
        self.checkpoint.read_into(name, self.scratch[:length], skip)
        src = self.scratch[:length].view(info.dtype).view((rows.length, *info.shape[1:]) if rows else info.shape)
        if shard is not None and rows is None:
            src = src.narrow(shard.dim, shard.start, shard.length)
        return src


def _row_range(info, shard):
    """(the shard if it takes whole rows, else None; its first byte; its byte length) within a stored
    tensor: a dim-0 shard is one contiguous byte range, so only those rows need reading."""
    rows = shard if shard is not None and shard.dim == 0 else None
    row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
    if rows is None:
        return None, 0, info.nbytes
    return rows, rows.start * row_bytes, rows.length * row_bytes
