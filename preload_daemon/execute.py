"""Runs a load plan: fills a destination (a shared slab, or private memory on the cold path) with
the plan's tensors in order, reading each checkpoint tensor once and quantizing where planned.

Reads run on a few threads, each a large pread straight from the file into the tensor's place in
the destination (its pages faulted in first in one system call: _fresh; a tensor larger than
READ_CHUNK is split across threads), so the disk has several requests in flight and page-cache
copies use every core; small tensors in a row are one job of about BATCH_BYTES, one preadv where
they lie back to back in the file (Checkpoint.read_many).
A TP shard reads only its own bytes: a row shard is one byte range, a column shard one range per
row. Conversion and quantization need a scratch copy of the source tensor; they run on the calling
thread, one at a time (torch, and the native quantization, spread each across the cores), while the
reads go on; quantization writes its parts straight into their places. The next large quantized
source is read into a second scratch buffer on the pool meanwhile (READ_AHEAD_BYTES). So the peak
extra memory stays two source tensors (and, where torch quantizes, the temporaries of a pass of a
few rows: kernels.quant), never a second copy of the model (temporaries freed on one thread are
reused there: on many threads, malloc's per-thread arenas would each keep some; a quantizing load
keeps them in the heap between weights, buffers.heap_kept). Where the native quantization runs,
the quantized sources not read ahead, in a row (and the small tensors between them), are one job on
the pool instead, of about sources.RUN_BYTES (or one larger source): read into the pool thread's
buffer (2 MiB a thread, more where a run needs it, for the load) and quantized in one native call;
the next large source is read ahead meanwhile too."""

import collections
import concurrent.futures
import contextlib
import os

import torch

from kernels import quant
from preload_daemon import sources
from preload_daemon.buffers import gc_paused, heap_kept, populate
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError
from preload_daemon.plan import LoadPlan, PlanEntry
from preload_daemon.reader import Reader, in_place, row_range
from preload_daemon.sources import quantize_into, quantize_run, quantized_read, quantized_run, source_group

READ_THREADS = max(2, min(8, os.cpu_count() or 2))
READ_CHUNK = 16 << 20
# Small tensors in a row are read as one job, which ends once it passes this many bytes (so holds under
# twice as many): the threads then read neighbouring ranges, which a disk takes about as one stream.
# Jobs of 16 MiB, one a thread, made two streams 16 MiB apart (a 2-core VM's virtual disk, 0.1 GB of
# 1.1 MB tensors: 100-127 ms against 61-70 with 1 MiB; 20,000 tensors from the page cache 467-516 ->
# 361-422 ms, from disk 581-658 -> 505-519).
BATCH_BYTES = 1 << 20
WINDOW = 4096  # groups in flight ahead of the oldest unfinished one ...
WINDOW_BYTES = 8 * READ_CHUNK  # ... and their bytes
HASH_SPAN = 1 << 20
# A quantized source at least this large is read ahead on the pool while the one before it is
# quantized. Smaller ones are read when their turn comes (in runs on the pool where the native
# quantization runs: sources.quantized_run): a hand-off to the pool costs about as much as their read
# from the page cache, and the kernel's own readahead already runs ahead of such short reads from
# disk (the default model's int8 load, page-cached: 196 ms read in turn, 222 read ahead; a 1 GB
# checkpoint of 10 MB weights from disk: see docs/benchmarks.md).
READ_AHEAD_BYTES = 4 << 20


def execute(plan: LoadPlan, checkpoint: Checkpoint, dest: torch.Tensor, on_tensor=None, hasher=None,
            threads: int = READ_THREADS, ready=None) -> None:
    """Fills `dest` (a flat uint8 tensor of plan.total_bytes). `hasher` (hashlib-style) sees every
    byte of dest exactly once, padding included, in order, as groups complete; `on_tensor(entry)`
    is called after each slab tensor; `ready(end)` (Slab.allocated), if given, before anything
    below `end` is written: it returns how far dest may be written, once that is at least `end`.

    The cyclic collector is held off meanwhile, as while the plan was built: each group in flight
    keeps a few objects (its futures, its slices) until it is finished, and with the headers and the
    plan alive every pass they set off walks them all and frees nothing (20,000 tensors from the
    page cache: 181-261 against 151-182 ms). What a load makes is freed by reference counting; the
    collector runs again when it ends. A quantizing load keeps its temporaries' memory (quantizing)."""
    if dest.dtype != torch.uint8 or dest.numel() != plan.total_bytes:
        raise ValueError(f"destination must be {plan.total_bytes} uint8 bytes, got {dest.numel()} {dest.dtype}")
    with gc_paused(), quantizing([plan]):
        _execute(plan, checkpoint, dest, on_tensor, hasher, threads, ready)
    if plan.spec.quantization == "fp8_block":
        check_stored_scales(plan, dest, checkpoint.path)


def check_stored_scales(plan: LoadPlan, dest: torch.Tensor, path) -> None:
    """A pre-quantized checkpoint's block scales, loaded as stored, must be finite and not negative
    (as a quantizing load's are): a NaN or an infinity makes its whole block NaN, a negative scale
    flips its signs. CheckpointError naming the first tensor with one. A checkpoint is pre-quantized
    whole or not at all (plan.py): at a quantized scale the load quantizes, and no entry is looked at
    past it (a quantizing load's 35,539 entries had cost 2 ms)."""
    for entry in plan.entries:
        if entry.part != "weight_scale":
            continue
        if entry.quantize:
            return
        scales = dest[entry.offset:entry.offset + entry.nbytes].view(torch.float32)
        bad = ~(scales >= 0) | torch.isinf(scales)  # (a NaN is not >= 0)
        if bool(bad.any()):
            first = float(scales[bad][0])
            raise CheckpointError(f"{path}: {entry.source!r} holds {int(bad.sum())} block scale(s) that are not "
                                  f"finite or are negative (the first: {first}); a pre-quantized block's scale is a "
                                  "finite positive number: re-export the checkpoint")


def quantizing(plans) -> contextlib.AbstractContextManager:
    """buffers.heap_kept() where any of `plans` quantizes (each of its weights' temporaries, freed
    before the next, then stays in the heap), else nothing."""
    if any(plan.spec.quantization != "none" and any(entry.quantize for entry in plan.entries) for plan in plans):
        return heap_kept()
    return contextlib.nullcontext()


def _execute(plan: LoadPlan, checkpoint: Checkpoint, dest: torch.Tensor, on_tensor, hasher, threads: int,
             ready) -> None:
    if checkpoint.read_ahead is not None:
        checkpoint.read_ahead.stop()  # from here the reads go ahead themselves
    checkpoint.open_files()  # before the threads share its descriptors
    memory = memoryview(dest.numpy())  # slicing a memoryview costs far less than slicing a tensor
    entries, tensors = plan.entries, checkpoint.tensors
    upcoming = _quantized_sources(entries)  # (first entry's index, source to read) of each quantized group
    # Runs take the quantized sources under READ_AHEAD_BYTES, which are never read ahead.
    many = sources.RUN_BYTES > 0 and bool(upcoming) and quant.many_native()
    hashed, in_flight, i = 0, 0, 0
    writable = plan.total_bytes if ready is None else 0
    pending: collections.deque = collections.deque()  # (entries, next_offset, futures, bytes) in plan order
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="load") as pool:
        reader = Reader(checkpoint, pool)
        try:
            while i < len(entries):
                # A run of small tensors read straight into place, or of quantized sources not read
                # ahead, is one job and one item (tiny tensors add up); anything else is a group of
                # its own: one tensor, or the parts of one quantized source.
                reads = _run_reads(tensors, entries, i, memory)
                run = quantized_run(tensors, entries, i, READ_AHEAD_BYTES) if many and not reads else []
                if reads:
                    group = entries[i:i + len(reads)]
                elif run:
                    group = entries[i:i + sum(len(item[0]) for item in run)]
                else:
                    group = source_group(entries, i)
                i += len(group)
                nbytes = group[-1].offset + group[-1].nbytes - group[0].offset
                next_offset = entries[i].offset if i < len(entries) else plan.total_bytes  # padding up to it
                if next_offset > writable:
                    writable = ready(next_offset)
                span = memory[group[0].offset:group[0].offset + nbytes]
                if reads and i < len(entries) and entries[i].quantize and nbytes < BATCH_BYTES:
                    # A quantizing load's norms between its projections: read here, as the next
                    # projection is. On the pool, beside the quantization, they left malloc's heap
                    # more fragmented: the load's peak memory 15-40 MB higher (test_quant_load).
                    _fresh(span, checkpoint.read_many, reads)
                    futures = []
                elif reads:
                    futures = [pool.submit(_fresh, span, checkpoint.read_many, reads)]
                elif run:
                    futures = [pool.submit(_fresh, span, quantize_run, checkpoint, run, dest)]
                    following = _next_source(upcoming, i, reader, READ_AHEAD_BYTES)
                    if following is not None:  # read meanwhile too, as after a source quantized alone
                        reader.read_ahead(*following)
                else:
                    if group[0].quantize:  # the next quantized source is read on the pool meanwhile
                        reader.upcoming = _next_source(upcoming, i, reader, READ_AHEAD_BYTES)
                    reads, jobs, inline = _jobs(reader, group, dest, memory)
                    if inline:  # through the scratch buffer, on this thread only (see the module doc)
                        populate(span)
                        try:
                            for job in jobs:
                                job()
                        except CheckpointError:
                            _raise_earlier(pending)  # a run before it failed too: its error comes first
                            raise
                        jobs = []
                    futures = [pool.submit(_fresh, read[1], checkpoint.read_many, [read]) for read in reads]
                    futures.extend(pool.submit(_fresh, span, job) for job in jobs)
                pending.append((group, next_offset, futures, nbytes))
                in_flight += nbytes
                while len(pending) > WINDOW or in_flight > WINDOW_BYTES:
                    in_flight -= pending[0][3]
                    hashed = _finish(pending.popleft(), memory, hashed, hasher, on_tensor)
            while pending:
                hashed = _finish(pending.popleft(), memory, hashed, hasher, on_tensor)
            if hasher is not None:
                hasher.update(memory[hashed:])
        except BaseException:
            for _, _, futures, _ in pending:
                for future in futures:
                    future.cancel()
            if reader.ahead is not None:
                reader.ahead[3].cancel()
            raise


def _next_source(queue: collections.deque, i: int, reader: Reader, least: int) -> tuple | None:
    """(name, shard) of the next quantized source from entry i on, if it reads at least `least` bytes:
    what to read ahead."""
    while queue and queue[0][0] < i:
        queue.popleft()
    return queue[0][1] if queue and reader.length(*queue[0][1]) >= least else None


def _raise_earlier(pending: collections.deque) -> None:
    """Raises the error of the first item in `pending` whose writes failed, if any did (waiting for
    them): the error a load gives is the first in plan order, wherever its weights were written."""
    for _, _, futures, _ in pending:
        for future in futures:
            future.result()


def _fresh(span: memoryview, write, *args) -> None:
    """write(*args), which fills `span` of the destination, after faulting in its pages in one
    system call (buffers.populate): the destination is fresh memory, which a write would fault in a
    page at a time."""
    populate(span)
    write(*args)


def _run_reads(tensors: dict, entries: tuple[PlanEntry, ...], i: int, memory: memoryview) -> list:
    """(name, destination bytes, skip) for Checkpoint.read_many of each tensor in the run from entry
    i on of tensors under BATCH_BYTES that go straight from the file to their place (as stored:
    whole, or whole rows), until they pass BATCH_BYTES; empty if entry i is not one of them. The
    loop body is the per-tensor cost of a checkpoint of tiny tensors: kept to lookups and a slice,
    so it states reader.in_place's rule inline (the stored dtype is the slab's, and the shard, if
    any, takes whole rows) instead of calling it; a change to one rule must change the other."""
    reads: list = []
    total = 0
    for j in range(i, len(entries)):  # by index: islice(entries, i) would step over the first i each call
        entry = entries[j]
        shard = entry.shard
        if entry.quantize or entry.nbytes >= BATCH_BYTES or total >= BATCH_BYTES \
                or (shard is not None and shard.dim != 0):
            break
        info = tensors[entry.source]
        if info.dtype != entry.dtype:
            break
        offset = entry.offset
        reads.append((entry.source, memory[offset:offset + entry.nbytes],
                      0 if shard is None else row_range(info, shard)[1]))
        total += entry.nbytes
    return reads


def groups(plan: LoadPlan):
    """The plan's entries grouped by what one write makes (source_group), in order."""
    i = 0
    while i < len(plan.entries):
        group = source_group(plan.entries, i)
        i += len(group)
        yield group


def _quantized_sources(entries: tuple[PlanEntry, ...]) -> collections.deque:
    """(index, (name, shard)) of the first entry of each quantized group, and what it reads."""
    return collections.deque((k, quantized_read(entry)) for k, entry in enumerate(entries)
                             if entry.quantize and not (k and entries[k - 1].quantize
                                                        and entries[k - 1].source == entry.source))


def _finish(item, memory: memoryview, hashed: int, hasher, on_tensor) -> int:
    """Waits for one item's writes and zeroes the padding after each of its tensors (fresh memory
    holds garbage); hashes the items done since `hashed` once they span HASH_SPAN bytes (a call per
    tiny tensor would cost more than hashing it). Returns the offset hashed up to."""
    group, next_offset, futures, _ = item
    for future in futures:
        future.result()
    for k, entry in enumerate(group):
        end, start = entry.offset + entry.nbytes, group[k + 1].offset if k + 1 < len(group) else next_offset
        if end < start:
            memory[end:start] = bytes(start - end)
        if on_tensor is not None:
            on_tensor(entry)
    if hasher is not None and next_offset - hashed >= HASH_SPAN:
        hasher.update(memory[hashed:next_offset])
        return next_offset
    return hashed


def _jobs(reader: Reader, group: tuple[PlanEntry, ...], dest: torch.Tensor,
          memory: memoryview) -> tuple[list, list, bool]:
    """What writes one group: direct reads of at most READ_CHUNK bytes each, as (name, destination
    bytes, skip) for Checkpoint.read_many (any thread); or jobs: one read per row of a column shard
    (any thread), or the whole group through the scratch buffer (conversion, quantization: the
    calling thread, which the last item says)."""
    entry, checkpoint = group[0], reader.checkpoint
    if entry.quantize:
        return [], [lambda: write_group(reader, group, dest)], True
    if not entry.nbytes:
        return [], [], False
    info = checkpoint.tensors[entry.source]
    if in_place(info, entry):
        skip = row_range(info, entry.shard)[1]
        start, end = entry.offset, entry.offset + entry.nbytes
        if entry.nbytes <= READ_CHUNK:  # one read, without a comprehension's frame
            return [(entry.source, memory[start:end], skip)], [], False
        return [(entry.source, memory[at:min(at + READ_CHUNK, end)], skip + at - start)
                for at in range(start, end, READ_CHUNK)], [], False
    out = dest[entry.offset:entry.offset + entry.nbytes]
    if info.dtype == entry.dtype and entry.shard.dim == 1 and len(info.shape) == 2:
        return [], [lambda: reader.read_columns(entry, out)], False
    return [], [lambda: reader.copy_into(entry, out)], True


def write_group(reader, group: tuple[PlanEntry, ...], dest: torch.Tensor) -> None:
    """Writes one group's bytes into `dest`. `reader` has read(name, shard) -> tensor and
    copy_into(entry, out): a checkpoint's files, or the tensor a publishing client just sent."""
    if group[0].quantize:
        quantize_into(reader, group, dest)
    elif group[0].nbytes:
        reader.copy_into(group[0], dest[group[0].offset:group[0].offset + group[0].nbytes])
