"""Rotary position embeddings: inverse frequencies (default and llama3 scaling), cos/sin tables and
their application in the rotate-half layout used by Hugging Face checkpoints."""

import math

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (float32, head_dim // 2). `scaling` is the rope_scaling/rope_parameters
    dict; rope_type "default" (or None) and "llama3" are supported."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return freqs
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not supported; supported: default, llama3")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, head_dim], computed in float32, returned in `dtype`."""
    angles = positions.float()[..., None] * freqs
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, T, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_reference(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same rotation as complex multiplication, pairing dimension i with i + head_dim/2."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    angles = positions.double()[:, None, :, None] * freqs.double()
    out = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((out.real, out.imag), dim=-1).to(x.dtype)


def rope_table(freqs: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sign-folded sin for positions 0..length-1, [length, 2, head_dim] in `dtype`: a decode
    step looks its rows up instead of recomputing them. The values are those of cos_sin; sin's first
    half is negated so that `rotate` needs no negation (exact: negation commutes with rounding)."""
    cos, sin = cos_sin(freqs, torch.arange(length), dtype)
    half = sin.shape[-1] // 2
    sin[:, :half].neg_()
    return torch.stack((cos, sin), dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope in the [..., heads, head_dim] layout the projections produce; cos, sin: rope_table
    rows for x's positions, [..., 1, head_dim] (broadcast over heads). Bitwise equal to apply_rope,
    as cat(x2, x1) * [-sin1, sin2] == cat(-x2, x1) * sin. `out` may be x itself."""
    return torch.add(x * cos, x.roll(x.shape[-1] // 2, -1) * sin, out=out)
