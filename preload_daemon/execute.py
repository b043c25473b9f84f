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
small quantized sources in a row (and the small tensors between them) are one job on the pool
instead, of about RUN_BYTES: read into the thread's buffer and quantized in one native call."""

import collections
import concurrent.futures
import contextlib
import os
import threading

import torch

from kernels import quant
from preload_daemon.buffers import gc_paused, heap_kept, populate
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError
from preload_daemon.plan import LoadPlan, PlanEntry
from preload_daemon.reader import Reader, row_range

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
# quantized. Smaller ones are read when their turn comes: a hand-off to the pool costs about as much
# as their read from the page cache, and the kernel's own readahead already runs ahead of such short
# reads from disk (the default model's int8 load, page-cached: 196 ms read in turn, 222 read ahead;
# a 1 GB checkpoint of 10 MB weights from disk: see docs/benchmarks.md).
READ_AHEAD_BYTES = 4 << 20
# Small quantized sources in a row, of one scheme and stored dtype, are one job on the pool, which
# ends once they pass this many bytes: read into one buffer and quantized in one native call
# (kernels.quant.quantize_many). One at a time, a weight's own Python and dispatch cost more than its
# bytes (20,000 tensors, int8, from the page cache: see docs/benchmarks.md).
RUN_BYTES = BATCH_BYTES
NATIVE_SOURCES = (torch.float32, torch.bfloat16, torch.float16)  # the stored dtypes quantize_many reads
_RUN_BUFFERS = threading.local()


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
    sources = _quantized_sources(entries)  # (first entry's index, source to read) of each quantized group
    many = RUN_BYTES > 0 and bool(sources) and quant.many_native()
    hashed, in_flight, i = 0, 0, 0
    writable = plan.total_bytes if ready is None else 0
    pending: collections.deque = collections.deque()  # (entries, next_offset, futures, bytes) in plan order
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="load") as pool:
        reader = Reader(checkpoint, pool)
        try:
            while i < len(entries):
                # A run of small tensors read straight into place, or of small quantized sources, is
                # one job and one item (tiny tensors add up); anything else is a group of its own:
                # one tensor, or the parts of one quantized source.
                reads = _run_reads(tensors, entries, i, memory)
                run = _quantized_run(tensors, entries, i) if many and not reads else []
                group = entries[i:i + len(reads)] if reads \
                    else entries[i:i + sum(map(len, run))] if run else _group(entries, i)
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
                    futures = [pool.submit(_fresh, span, _quantize_run, checkpoint, run, dest)]
                else:
                    if group[0].quantize:  # the next quantized source is read on the pool meanwhile
                        while sources and sources[0][0] < i:  # (i: past this group)
                            sources.popleft()
                        if sources and reader.length(*sources[0][1]) >= READ_AHEAD_BYTES:
                            reader.upcoming = sources[0][1]
                    reads, jobs, inline = _jobs(reader, group, dest, memory)
                    if inline:  # through the scratch buffer, on this thread only (see the module doc)
                        populate(span)
                        for job in jobs:
                            job()
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
    so it states _jobs' rule for a direct read inline (the stored dtype is the slab's, and the
    shard, if any, takes whole rows: row_range's "rows") instead of calling it; a change to one
    rule must change the other."""
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


def _quantized_run(tensors: dict, entries: tuple[PlanEntry, ...], i: int) -> list[tuple[PlanEntry, ...]]:
    """The groups from entry i on that _quantize_run writes together, until they pass RUN_BYTES: small
    2-D quantized sources of one scheme and stored dtype, each read as quantize() takes it (whole, or a
    row shard whose scales lie within it), and between them small tensors read straight into place
    (a model's norms); the first one quantized. Empty where that is fewer than two groups."""
    run: list = []
    first, total, j = entries[i], 0, i
    while j < len(entries) and total < RUN_BYTES:
        entry = entries[j]
        shard = entry.shard
        if not entry.quantize:  # read straight into place, as _run_reads and _jobs read it
            info = tensors[entry.source]
            if not run or entry.nbytes >= RUN_BYTES or info.dtype != entry.dtype \
                    or (shard is not None and shard.dim != 0):
                break
            run.append((entry,))
            total += entry.nbytes
            j += 1
            continue
        name, read = _quantized_read(entry)
        info = tensors[name]
        if entry.quant_scheme != first.quant_scheme or read is not shard or (shard is not None and shard.dim != 0) \
                or len(info.shape) != 2 or info.dtype not in NATIVE_SOURCES \
                or info.dtype != tensors[first.source].dtype:
            break
        length = row_range(info, shard)[2]
        if not length or length >= RUN_BYTES:
            break
        run.append(_group(entries, j))
        total += length
        j += len(run[-1])
    return run if len(run) > 1 else []


def _quantize_run(checkpoint: Checkpoint, run: list[tuple[PlanEntry, ...]], dest: torch.Tensor) -> None:
    """Reads a run's sources, the quantized ones into this thread's buffer (each at a multiple of 64
    bytes) and the others into place, in one preadv where they lie back to back in the file, and
    quantizes the former into their parts' places in one native call."""
    tensors = checkpoint.tensors
    places, size = [], 0  # each group's place in the buffer, or None: read straight into dest
    for group in run:
        places.append(size if group[0].quantize else None)
        if group[0].quantize:
            size += -(-row_range(tensors[group[0].source], group[0].shard)[2] // 64) * 64
    buffer = _run_buffer(size)
    memory, into = memoryview(buffer.numpy()), memoryview(dest.numpy())
    reads, weights, quantized = [], [], []
    for group, at in zip(run, places):
        entry = group[0]
        info = tensors[entry.source]
        rows, skip, length = row_range(info, entry.shard)
        if at is None:
            reads.append((entry.source, into[entry.offset:entry.offset + entry.nbytes], skip))
            continue
        reads.append((entry.source, memory[at:at + length], skip))
        parts = {part.part: part for part in group}
        weight, scale, extra = parts["weight"], parts["weight_scale"], parts.get("weight_global_scale")
        weights += (at, rows.length if rows else info.shape[0], info.shape[1], weight.offset, weight.nbytes,
                    scale.offset, scale.nbytes, extra.offset if extra else -1)
        quantized.append((entry, at, length))
    checkpoint.read_many(reads)
    first = quantized[0][0]
    dtype = tensors[first.source].dtype
    bad = quant.quantize_many(buffer, dtype, weights, dest, first.quant_scheme)
    if bad >= 0:  # that weight's error, as quantizing it alone would raise it
        entry, at, length = quantized[bad]
        try:
            quant.refuse_non_finite(buffer[at:at + length].view(dtype))
        except ValueError as e:
            raise _unquantizable(entry, e) from e


def _run_buffer(size: int) -> torch.Tensor:
    """This pool thread's buffer for runs, its first `size` bytes (grown as needed): a new one a run
    faulted its pages in each time (the thread's own, and freed with it when the load's pool ends)."""
    buffer = getattr(_RUN_BUFFERS, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _RUN_BUFFERS.buffer = torch.empty(max(size, RUN_BYTES * 2), dtype=torch.uint8)
    return buffer[:size]


def groups(plan: LoadPlan):
    """The plan's entries grouped by what one write makes (_group), in order."""
    i = 0
    while i < len(plan.entries):
        group = _group(plan.entries, i)
        i += len(group)
        yield group


def _quantized_sources(entries: tuple[PlanEntry, ...]) -> collections.deque:
    """(index, (name, shard)) of the first entry of each quantized group, and what it reads."""
    return collections.deque((k, _quantized_read(entry)) for k, entry in enumerate(entries)
                             if entry.quantize and not (k and entries[k - 1].quantize
                                                        and entries[k - 1].source == entry.source))


def _quantized_read(entry: PlanEntry) -> tuple:
    """(name, shard) of what quantizing `entry` reads: a TP rank reads its shard where the shard's
    scales lie within it (a row's, a block's); scales that span it (per tensor, NVFP4's global, a
    whole row's of a shard along K) need the whole weight."""
    found, shard = quant.scheme(entry.quant_scheme), entry.shard
    if shard is None or not (found.weight_scale or (shard.dim == 1 and found.row_scale)):
        return entry.source, shard
    return entry.source, None


def _group(entries: tuple[PlanEntry, ...], i: int) -> tuple[PlanEntry, ...]:
    """The entries one write makes from entry i: the parts of one quantized source (they follow each
    other), or one copied tensor."""
    j = i + 1
    if entries[i].quantize:
        while j < len(entries) and entries[j].quantize and entries[j].source == entries[i].source:
            j += 1
    return entries[i:j]


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
    rows, skip, _ = row_range(info, entry.shard)
    if info.dtype == entry.dtype and entry.shard is rows:
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
        _quantize_into(reader, group, dest)
    elif group[0].nbytes:
        reader.copy_into(group[0], dest[group[0].offset:group[0].offset + group[0].nbytes])


def _quantize_into(reader, group: tuple[PlanEntry, ...], dest: torch.Tensor) -> None:
    """Quantizes one source into its parts' places in dest (kernels.quant writes them there, or
    copies them there where it quantizes in torch). A TP rank holds exactly TP=1's parts of its
    shard, and quantizes only its shard, from what _quantized_read says it reads."""
    first, shard = group[0], group[0].shard
    out = {entry.part: dest[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
           for entry in group}
    name, read = _quantized_read(first)
    try:
        if read is shard:
            quant.quantize(reader.read(name, shard), first.quant_scheme, out=out)
        else:
            quant.quantize_part(reader.read(name, None), first.quant_scheme, shard.dim, shard.start, shard.length,
                                out=out)
    except ValueError as e:
        raise _unquantizable(first, e) from e


def _unquantizable(entry: PlanEntry, e: ValueError) -> CheckpointError:
    return CheckpointError(f"cannot quantize {entry.source!r} to {entry.quant_scheme}: {e}")
