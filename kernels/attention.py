"""Grouped-query attention over a KV cache: each query at position p sees keys 0..p of its own
sequence (and none past the sequence's length)."""

import torch
import torch.nn.functional as F

from kernels import native


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """q: [B, H, T, D]; k, v: [B, KV, S, D] with H a multiple of KV; q_positions: [B, T] absolute
    positions of the queries (keys sit at positions 0..S-1). Returns [B, H, T, D]."""
    batch, heads, t, d = q.shape
    s = k.shape[2]
    if heads % k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k.shape[1]} kv heads")
    if batch == 1 and t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = torch.arange(s, device=q.device)[None, None, :] <= q_positions[:, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def attention_reference(q, k, v, q_positions):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    keys = torch.arange(k.shape[2], device=q.device)
    scores = scores.masked_fill(keys[None, None, None, :] > q_positions[:, None, :, None], float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Attention of new queries over a float32 cache, as float32 GEMMs: q [B, T, H, D] (the
    projections' layout and dtype); k, v [B, KV, S, D] float32 with H a multiple of KV, any strides
    with a contiguous last dimension (views of the cache: nothing is gathered or converted);
    hidden: None when every query sees all S keys, else bool [B, 1, 1, T, S], True where a key is
    not visible. Returns [B, T, H * D] in q's dtype. Scores are scaled after the product and the
    softmax runs in float32, as torch's CPU flash attention does."""
    batch, t, heads, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    groups = heads // kv_heads
    # Query head j * groups + g reads kv head j: rows (g, t) of kv head j's product.
    queries = q.view(batch, t, kv_heads, groups, d).permute(0, 2, 3, 1, 4).float().reshape(batch * kv_heads, -1, d)
    scores = torch.bmm(queries, k.flatten(0, 1).transpose(1, 2)).mul_(d ** -0.5)
    if hidden is not None:
        scores.view(batch, kv_heads, groups, t, s).masked_fill_(hidden, float("-inf"))
    out = torch.bmm(scores.softmax(-1), v.flatten(0, 1)).view(batch, kv_heads, groups, t, d)
    return out.permute(0, 3, 1, 2, 4).to(q.dtype).reshape(batch, t, heads * d)


def has_decode_attention(dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")) -> bool:
    """Whether decode_attention runs for a cache of `dtype` on `device`: the native kernels are
    built and chosen, and it is a float32 or bfloat16 CPU cache (float16 takes torch's SDPA)."""
    return native.decode_attention is not None and dtype in (torch.float32, torch.bfloat16) and device.type == "cpu"


def decode_attention(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """One new query per sequence over its cached keys, read in place (kernels/csrc/decode.cpp):
    q [B, H, D]; cache: one layer of the engine's KV cache, [slots, 2, KV, max_len, D] in q's dtype;
    row b sees positions [0, lengths[b]) of slot slots[b] (int64 [B] both). Returns [B, H * D] in
    q's dtype, the softmax in float32. Only where has_decode_attention()."""
    return native.decode_attention(q.contiguous(), cache, slots, lengths, q.shape[-1] ** -0.5,
                                   native.variant_index()).view(q.shape[0], -1)


PREFILL_VARIANTS = ("avx512bf16",)
"""The kernel variants whose prefills take prefill_attention (AVX512-BF16's dot product for q.k and
p.v). Not amx: on CPUs with AMX, SDPA's CPU flash kernel multiplies on the tiles, and took a third
to a fifth of the dot product's time a layer (a 2-core Emerald Rapids, the default model's heads,
bfloat16: 100 positions 0.11 against 0.17 ms, 500 1.35 against 3.38, 2,000 10.8 against 50.0)."""


def has_prefill_attention(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether prefill_attention runs: bfloat16 on the CPU, heads of 32, 64, 96 or 128, and a
    variant of PREFILL_VARIANTS chosen."""
    return (native.prefill_attention is not None and native.VARIANT in PREFILL_VARIANTS and dtype == torch.bfloat16
            and device.type == "cpu" and head_dim in (32, 64, 96, 128))


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Causal attention of prompts from position 0 over their own keys and values, read in place
    from the cache (kernels/csrc/decode.cpp), where they were written first: q [B, T, H, D]; cache:
    one layer of the engine's KV cache, [slots, 2, KV, max_len, D], row b's positions [0, T) in
    slot slots[b] (int64 [B]). Returns [B, T, H, D], bfloat16 like q: the sums and softmax in
    float32, the probabilities rounded to bfloat16 for their product with the values (as torch's
    flash attention rounds them). Each row is computed alone. Only where has_prefill_attention()."""
    return native.prefill_attention(q.contiguous(), cache, slots, q.shape[-1] ** -0.5, native.variant_index())
