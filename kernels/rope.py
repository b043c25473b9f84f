"""Rotary position embeddings: inverse frequencies (default, linear, llama3 and yarn scaling),
cos/sin tables and their application in the rotate-half layout used by Hugging Face checkpoints."""

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The rope_type values of config.json's rope_parameters (or rope_scaling) that inv_freq computes."""


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (float32, head_dim // 2). `scaling` is the rope_scaling/rope_parameters
    dict (ROPE_TYPES), with original_max_position_embeddings filled in where the type needs it."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return freqs
    if kind == "linear":  # positions divided by the factor, which is the same as the frequencies
        return freqs / scaling["factor"]
    if kind == "yarn":
        return _yarn(freqs, head_dim, theta, scaling)
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than beta_slow times over the original
    context are interpolated (divided by the factor), those that turn more than beta_fast times are
    kept, and a linear ramp over the dimension index blends the two in between."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # in transformers' order of operations, so that the result is bitwise theirs
    positions = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (factor * positions) * (1 - keep) + freqs * keep


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: 1 but for yarn, whose attention_factor defaults to
    0.1 ln(factor) + 1 (or the ratio of two such with mscale and mscale_all_dim, DeepSeek's)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, head_dim], computed in float32 (times `scale`, the
    attention_factor; exact when it is 1), returned in `dtype`."""
    angles = positions.float()[..., None] * freqs
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


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


def rope_table(freqs: torch.Tensor, length: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """cos and sign-folded sin for positions 0..length-1, [length, 2, head_dim] in `dtype`: a decode
    step looks its rows up instead of recomputing them. The values are those of cos_sin; sin's first
    half is negated so that `rotate` needs no negation (exact: negation commutes with rounding)."""
    cos, sin = cos_sin(freqs, torch.arange(length), dtype, scale)
    half = sin.shape[-1] // 2
    sin[:, :half].neg_()
    return torch.stack((cos, sin), dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope in the [..., heads, head_dim] layout the projections produce; cos, sin: rope_table
    rows for x's positions, [..., 1, head_dim] (broadcast over heads). Bitwise equal to apply_rope,
    as cat(x2, x1) * [-sin1, sin2] == cat(-x2, x1) * sin. `out` may be x itself."""
    return torch.add(x * cos, x.roll(x.shape[-1] // 2, -1) * sin, out=out)
