"""The KV cache of an engine and one forward's plan over it (`plan_step`): where each layer writes
its new keys and values and which cached ones its attention reads, worked out once per forward
for every layer (worker/model.py builds the rope rows and runs the layers)."""

import dataclasses
import math
import mmap

import torch

from kernels.attention import has_decode_attention


class KVCache:
    """Static per-slot cache of every layer's keys and values: [num_layers, slots, 2, kv_heads,
    max_len, head_dim], each kv head's keys (and values) in order of position, so that attention
    over one kv head streams through memory, and a layer's live keys are the [slots, kv_heads,
    length, head_dim] view SDPA takes. A forward takes each layer's views with a few indexing calls
    for all layers. On CPU it lives in one private anonymous mapping, whose pages the kernel
    zero-fills on first touch: a large cache costs nothing at start-up, and unwritten positions read
    as zeros, never garbage. On a GPU it is one zeroed allocation."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device = torch.device("cpu")):
        shape = (num_layers, num_slots, 2, num_kv_heads, max_len, head_dim)
        # Private: MADV_DONTNEED then frees the pages (on a shared mapping the shmem pages would stay).
        self._mapping = None if device.type != "cpu" else \
            mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.all = torch.zeros(shape, dtype=dtype, device=device) if self._mapping is None else \
            torch.frombuffer(self._mapping, dtype=dtype).view(shape)
        self.layers = self.all.unbind(0)
        self.num_slots = num_slots
        self.max_len = max_len

    def drop_pages(self) -> None:
        """Gives the cache's pages back to the kernel: every position reads as zeros again, and a
        process snapshot taken now stores none of them. Only while no forward runs."""
        if self._mapping is not None:
            return self._mapping.madvise(mmap.MADV_DONTNEED)
        self.all.zero_()


@dataclasses.dataclass(slots=True)
class Step:
    """What every layer of one forward shares, computed once per forward: rope rows, and where each
    layer writes its new keys and values and reads the cached ones."""

    cos: torch.Tensor
    """[B * T, 1, head_dim], like sin (rope_table's sign-folded sin)."""
    sin: torch.Tensor
    length: int
    """Cache positions the queries read: 0 .. length-1."""
    exact: bool
    """One sequence: torch's own products for several rows (a prefill), whose rows do not depend on
    how many come together; one row takes the native GEMV where it is built (kernels/dense.py). With
    PRELOAD_KERNELS=torch the logits are bit for bit those transformers computes; the native GEMV,
    norm and decode and prefill attentions round in another order. Several sequences: the faster paths
    (kernels/dense.py, cached_attention), equal up to rounding."""
    writes: torch.Tensor | None = None
    """One sequence: [layers, 2, KV, T, D], where its new keys and values go in each layer's cache."""
    keys: tuple = ()
    """One sequence: per layer, the live [1, KV, length, D] keys, and values; several rows at
    consecutive slots: per layer, their live [B, 2, KV, length, D] cache (else gathered per layer)."""
    values: tuple = ()
    causal: bool = False
    """Every row from position 0 (a prefill, or prompts of one length prefilled together): attention
    runs over the new keys alone, causally (the native prefill attention reads them back from the
    cache, where they were just written; SDPA takes them as computed)."""
    visible: torch.Tensor | None = None
    """One sequence past position 0 with several tokens: SDPA's [1, 1, T, length] mask."""
    lengths: torch.Tensor | None = None
    """One new token a row, with the native decode attention: each row's cache length, int64 [B]
    (and slot_ids its slot, rope its rope_table rows); then keys, values, visible and hidden stay unset."""
    rope: torch.Tensor | None = None
    slot_ids: torch.Tensor | None = None
    """Each row's cache slot, int64 [B], for the native attentions: decode's (with lengths), and a
    causal prefill's."""
    slots: torch.Tensor | None = None
    """Several rows: [B, 1] slots and [B, T] positions for the cache writes."""
    positions: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    """Several rows: cached_attention's [B, 1, 1, T, length] mask of keys not visible (None: all are)."""


def plan_step(positions: torch.Tensor, rows: list[list[int]], length: int, slots: torch.Tensor, cache: KVCache,
              table: torch.Tensor) -> Step:
    """The Step of a forward of `positions` ([B, T]; `rows` the same as lists, `length` the largest
    plus one) in cache `slots` ([B]), with `table` the positions' rope rows ([B * T, 1, 2, D], on
    the model's device)."""
    batch, t = positions.shape
    device = table.device
    step = Step(table[:, :, 0], table[:, :, 1], length, exact=batch == 1,
                slot_ids=slots.to(torch.int64).contiguous())
    if t == 1 and has_decode_attention(cache.all.dtype, cache.all.device):  # decode: reads the cache in place
        step.lengths, step.rope = positions[:, 0] + 1, table
    if batch == 1:  # one sequence at consecutive positions: prefill, decode, a draft's catch-up
        slot, start = int(slots[0]), rows[0][0]
        step.writes = cache.all[:, slot, :, :, start:start + t]
        step.causal = start == 0
        if not step.causal and step.lengths is None:
            live = cache.all[:, slot, :, None, :, :length]  # [layers, 2, 1, KV, length, D]
            step.keys, step.values = live[:, 0].unbind(0), live[:, 1].unbind(0)
            if t > 1:
                visible = torch.arange(length) <= positions[0, :, None]
                step.visible = visible.view(1, 1, t, length).to(device)
        return step
    step.slots, step.positions = slots[:, None].to(device), positions.to(device)
    if step.lengths is not None:
        return step
    if rows[0] == list(range(t)) and all(r == rows[0] for r in rows):
        step.causal = True  # prompts prefilled together: causal attention over their own keys, no mask
        return step
    first = int(slots[0])
    if slots.tolist() == list(range(first, first + batch)):  # a view, no gather
        step.keys = cache.all[:, first:first + batch, :, :, :length].unbind(0)
    if t > 1 or any(r[0] != length - 1 for r in rows):  # not every query sees every key
        hidden = torch.arange(length) > positions[:, :, None]
        step.hidden = hidden.view(batch, 1, 1, t, length).to(device)
    return step
