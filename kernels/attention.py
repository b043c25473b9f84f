"""Grouped-query attention over a KV cache: each query at position p sees keys 0..p of its own
sequence (and none past the sequence's length)."""

import torch
import torch.nn.functional as F


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
