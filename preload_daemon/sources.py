"""How a load quantizes its sources (execute.py runs them in plan order): one at a time, each read
into a scratch buffer and quantized into its parts' places (quantize_into; kernels.quant writes them
there, or copies them there where it quantizes in torch), or, where the native quantization runs,
small ones in runs: read together into the pool thread's buffer and quantized in one native call
(quantized_run, quantize_run)."""

import threading

import torch

from kernels import quant
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError
from preload_daemon.plan import PlanEntry
from preload_daemon.reader import in_place, row_range

# Quantized sources in a row that are not read ahead (execute.READ_AHEAD_BYTES), of one scheme and
# stored dtype, are one job on the pool, which ends once they pass this many bytes: read into one
# buffer and quantized in one native call (kernels.quant.quantize_many). One at a time, a small
# weight's own Python and dispatch cost more than its bytes (20,000 tensors, int8, from the page
# cache), and one of a few MiB, quantized on the loading thread, left the pool idle (the default
# model's MLP projections: see docs/benchmarks.md); a source this large or larger ends its run, or is
# one alone.
RUN_BYTES = 1 << 20  # (execute.BATCH_BYTES: the runs of tensors read straight into place end there too)
NATIVE_SOURCES = (torch.float32, torch.bfloat16, torch.float16)  # the stored dtypes quantize_many reads
_RUN_BUFFERS = threading.local()


def quantized_read(entry: PlanEntry) -> tuple:
    """(name, shard) of what quantizing `entry` reads: a TP rank reads its shard where the shard's
    scales lie within it (a row's, a block's); scales that span it (per tensor, NVFP4's global, a
    whole row's of a shard along K) need the whole weight."""
    found, shard = quant.scheme(entry.quant_scheme), entry.shard
    if shard is None or not (found.weight_scale or (shard.dim == 1 and found.row_scale)):
        return entry.source, shard
    return entry.source, None


def source_group(entries: tuple[PlanEntry, ...], i: int) -> tuple[PlanEntry, ...]:
    """The entries one write makes from entry i: the parts of one quantized source (they follow each
    other), or one copied tensor."""
    j = i + 1
    if entries[i].quantize:
        while j < len(entries) and entries[j].quantize and entries[j].source == entries[i].source:
            j += 1
    return entries[i:j]


def quantize_into(reader, group: tuple[PlanEntry, ...], dest: torch.Tensor) -> None:
    """Quantizes one source into its parts' places in dest (kernels.quant writes them there, or
    copies them there where it quantizes in torch). A TP rank holds exactly TP=1's parts of its
    shard, and quantizes only its shard, from what quantized_read says it reads."""
    first, shard = group[0], group[0].shard
    out = {entry.part: dest[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
           for entry in group}
    name, read = quantized_read(first)
    try:
        if read is shard:
            quant.quantize(reader.read(name, shard), first.quant_scheme, out=out)
        else:
            quant.quantize_part(reader.read(name, None), first.quant_scheme, shard.dim, shard.start, shard.length,
                                out=out)
    except ValueError as e:
        raise unquantizable(first, e) from e


def unquantizable(entry: PlanEntry, e: ValueError) -> CheckpointError:
    return CheckpointError(f"cannot quantize {entry.source!r} to {entry.quant_scheme}: {e}")


def quantized_run(tensors: dict, entries: tuple[PlanEntry, ...], i: int, largest: int) -> list[tuple]:
    """The groups from entry i on that quantize_run writes together, until they pass RUN_BYTES: 2-D
    quantized sources under `largest` bytes (execute reads larger ones ahead) of one scheme and stored
    dtype, each read as quantize() takes it (whole, or a row shard whose scales lie within it), and
    after each the small tensors read straight into place that follow it (a model's norms). Each as
    (group, its row_range: rows, skip, length), for quantize_run. Empty where entry i is no such
    source."""
    run: list = []
    first, total, j = entries[i], 0, i
    while j < len(entries) and total < RUN_BYTES:
        entry = entries[j]
        shard = entry.shard
        if not entry.quantize:  # read straight into place, as execute reads such tensors
            info = tensors[entry.source]
            if not run or entry.nbytes >= RUN_BYTES or not in_place(info, entry):
                break
            run.append(((entry,), *row_range(info, shard)))
            total += entry.nbytes
            j += 1
            continue
        name, read = quantized_read(entry)
        info = tensors[name]
        if entry.quant_scheme != first.quant_scheme or read is not shard or (shard is not None and shard.dim != 0) \
                or len(info.shape) != 2 or info.dtype not in NATIVE_SOURCES \
                or info.dtype != tensors[first.source].dtype:
            break
        rows, skip, length = row_range(info, shard)
        if not length or length >= largest:
            break
        group = source_group(entries, j)
        run.append((group, rows, skip, length))
        total += length
        j += len(group)
    return run


def quantize_run(checkpoint: Checkpoint, run: list[tuple], dest: torch.Tensor) -> None:
    """Reads a run (quantized_run's) of sources, the quantized ones into this thread's buffer (each at
    a multiple of 64 bytes) and the others into place, in one preadv where they lie back to back in
    the file, and quantizes the former into their parts' places in one native call."""
    tensors = checkpoint.tensors
    size = sum(-(-length // 64) * 64 for group, _, _, length in run if group[0].quantize)
    buffer = _run_buffer(size)
    memory, into = memoryview(buffer.numpy()), memoryview(dest.numpy())
    reads, weights, quantized, at = [], [], [], 0
    for group, rows, skip, length in run:
        entry = group[0]
        if not entry.quantize:
            reads.append((entry.source, into[entry.offset:entry.offset + entry.nbytes], skip))
            continue
        reads.append((entry.source, memory[at:at + length], skip))
        parts = {part.part: part for part in group}
        weight, scale, extra = parts["weight"], parts["weight_scale"], parts.get("weight_global_scale")
        shape = tensors[entry.source].shape
        weights += (at, rows.length if rows else shape[0], shape[1], weight.offset, weight.nbytes,
                    scale.offset, scale.nbytes, extra.offset if extra else -1)
        quantized.append((entry, at, length))
        at += -(-length // 64) * 64
    checkpoint.read_many(reads)
    first = quantized[0][0]
    dtype = tensors[first.source].dtype
    bad = quant.quantize_many(buffer, dtype, weights, dest, first.quant_scheme)
    if bad >= 0:  # that weight's error, as quantizing it alone would raise it
        entry, at, length = quantized[bad]
        try:
            quant.refuse_non_finite(buffer[at:at + length].view(dtype))
        except ValueError as e:
            raise unquantizable(entry, e) from e
        raise CheckpointError(f"cannot quantize {entry.source!r} to {entry.quant_scheme}: the native quantization "
                              "found a value that is not finite, torch none; report this")


def _run_buffer(size: int) -> torch.Tensor:
    """The first `size` bytes of this pool thread's buffer for runs (2 MiB, grown as a run needs: under
    RUN_BYTES plus its last source, which is under execute.READ_AHEAD_BYTES: about 5 MiB at most):
    one for the thread's runs, not a new one a run, whose pages would be faulted in each time. It goes
    with the thread, when the load's pool ends."""
    buffer = getattr(_RUN_BUFFERS, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _RUN_BUFFERS.buffer = torch.empty(max(size, RUN_BYTES * 2), dtype=torch.uint8)
    return buffer[:size]
