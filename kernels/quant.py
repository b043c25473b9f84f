"""Weight quantization schemes (see docs/architecture.md), vectorised, pure torch. Each scheme turns an
[N, K] weight into named parts (`weight`, `weight_scale`, and for nvfp4 `weight_global_scale`) and
back. `layout` gives the parts' dtypes and shapes before any data exists, for slab planning.

Conventions: dequantised = element x scale. Block scales run along K (the input dimension); K that
is not a multiple of the block is zero-padded in the stored weight. Non-finite weights are refused
(ValueError); finite values beyond a format's range saturate to its largest magnitude.
"""

import dataclasses

import torch
import torch.nn.functional as F

from kernels.formats import BLOCKS, FP8_BLOCK, MX_BLOCK, NV_BLOCK, SCHEMES
from kernels.fp4 import E2M1_MAX, decode_packed, e2m1_encode, pack

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
E4M3_MAX = 448.0
INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A quantized [N, K] weight: its scheme, stored parts and logical shape."""

    scheme: str
    weight: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        parts = (self.weight, self.scale, self.global_scale)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def layout(scheme: str, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{part: (dtype, shape)} of a quantized [n, k] weight."""
    if scheme == "fp8_per_tensor":
        return {"weight": (E4M3, (n, k)), "weight_scale": (torch.float32, ())}
    if scheme == "fp8_per_channel":
        return {"weight": (E4M3, (n, k)), "weight_scale": (torch.float32, (n,))}
    if scheme == "fp8_block":
        return {"weight": (E4M3, (n, k)), "weight_scale": (torch.float32, (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)))}
    if scheme == "int8":
        return {"weight": (torch.int8, (n, k)), "weight_scale": (torch.float32, (n,))}
    if scheme == "mxfp8":
        kp = _ceil_to(k, MX_BLOCK)
        return {"weight": (E4M3, (n, kp)), "weight_scale": (E8M0, (n, kp // MX_BLOCK))}
    if scheme == "mxfp4":
        kp = _ceil_to(k, MX_BLOCK)
        return {"weight": (torch.uint8, (n, kp // 2)), "weight_scale": (E8M0, (n, kp // MX_BLOCK))}
    if scheme == "nvfp4":
        kp = _ceil_to(k, NV_BLOCK)
        return {"weight": (torch.uint8, (n, kp // 2)), "weight_scale": (E4M3, (n, kp // NV_BLOCK)),
                "weight_global_scale": (torch.float32, ())}
    raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")


def quantize(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    if w.dim() != 2:
        raise ValueError(f"quantization needs a 2-D weight, got shape {list(w.shape)}")
    bad = int((~torch.isfinite(w)).sum())
    if bad:
        raise ValueError(f"weight has {bad} non-finite value(s) (inf/nan); refusing to quantize it")
    n, k = w.shape
    w = w.float()
    if scheme in ("fp8_per_tensor", "fp8_per_channel", "int8"):
        amax = w.abs().amax() if scheme == "fp8_per_tensor" else w.abs().amax(dim=1)
        limit = INT8_MAX if scheme == "int8" else E4M3_MAX
        scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
        scaled = w / (scale if scale.dim() == 0 else scale[:, None])
        q = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8) if scheme == "int8" \
            else scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return QuantizedWeight(scheme, q, scale, None, (n, k))
    if scheme == "fp8_block":
        nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        blocks = F.pad(w, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n)).view(nb, FP8_BLOCK, kb, FP8_BLOCK)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return QuantizedWeight(scheme, q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous(), scale, None, (n, k))
    if scheme in ("mxfp8", "mxfp4"):
        kp = _ceil_to(k, MX_BLOCK)
        blocks = F.pad(w, (0, kp - k)).view(n, kp // MX_BLOCK, MX_BLOCK)
        # OCP MX: shared exponent = floor(log2(amax)) - emax of the element format (e4m3: 8, e2m1: 2).
        _, exponent = torch.frexp(blocks.abs().amax(dim=-1))
        emax = 8 if scheme == "mxfp8" else 2
        shared = torch.where(blocks.abs().amax(dim=-1) > 0, exponent - 1 - emax, torch.full_like(exponent, -127))
        shared = shared.clamp(-127, 127)
        scaled = blocks * torch.exp2(-shared.float())[..., None]
        scale = (shared + 127).to(torch.uint8).view(E8M0)
        if scheme == "mxfp8":
            return QuantizedWeight(scheme, scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(n, kp), scale, None, (n, k))
        return QuantizedWeight(scheme, pack(e2m1_encode(scaled.view(n, kp))), scale, None, (n, k))
    if scheme == "nvfp4":
        kp = _ceil_to(k, NV_BLOCK)
        blocks = F.pad(w, (0, kp - k)).view(n, kp // NV_BLOCK, NV_BLOCK)
        amax = w.abs().amax()
        global_scale = amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else torch.tensor(1.0)
        block_scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(E4M3)
        total = block_scale.float() * global_scale
        scaled = torch.where(total[..., None] > 0, blocks / total[..., None], torch.zeros_like(blocks))
        return QuantizedWeight(scheme, pack(e2m1_encode(scaled.view(n, kp))), block_scale,
                               global_scale.float().reshape(()), (n, k))
    raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")


def narrow(q: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight:
    """Rows (dim 0) or input columns (dim 1) [start, start + length) of a quantized weight, as the
    parts a quantization of that slice alone would have if it used the whole weight's scales: the
    slice must fall on the scheme's block boundaries (128 for fp8_block, 32 for MX, 16 for NVFP4)."""
    n, k = q.shape
    if dim not in (0, 1) or not (0 <= start and length > 0 and start + length <= q.shape[dim]):
        raise ValueError(f"bad slice [{start}, {start + length}) of dim {dim} of a {list(q.shape)} weight")
    row_block, col_block = BLOCKS.get(q.scheme, (1, 1))
    if start == 0 and length == q.shape[dim]:
        return q
    block = row_block if dim == 0 else col_block
    if start % block or length % block:
        raise ValueError(f"slice [{start}, {start + length}) of dim {dim} does not fall on {q.scheme}'s "
                         f"{block}-element blocks")
    packed = 2 if q.scheme in ("mxfp4", "nvfp4") else 1
    if dim == 0:
        weight = q.weight[start:start + length]
    else:
        weight = q.weight[:, start // packed:(start + length) // packed]
    scale = q.scale
    if q.scheme == "fp8_block":
        blocks = slice(start // FP8_BLOCK, -(-(start + length) // FP8_BLOCK))
        scale = scale[blocks] if dim == 0 else scale[:, blocks]
    elif scale.dim() >= 1 and dim == 0:
        scale = scale[start:start + length]
    elif scale.dim() == 2:  # MX / NVFP4 block scales along K
        scale = scale[:, start // block:(start + length) // block]
    shape = (length, k) if dim == 0 else (n, length)
    return QuantizedWeight(q.scheme, weight.contiguous(), scale.contiguous(), q.global_scale, shape)


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
    """The [N, K] weight (or the `rows` slice of it) in `dtype`."""
    n, k = q.shape
    start, stop, _ = rows.indices(n)
    if q.scheme == "fp8_per_tensor":
        return (q.weight[start:stop].float() * q.scale).to(dtype)
    if q.scheme in ("fp8_per_channel", "int8"):
        return (q.weight[start:stop].float() * q.scale[start:stop, None]).to(dtype)
    if q.scheme == "fp8_block":
        scale = q.scale.repeat_interleave(FP8_BLOCK, 0)[start:stop].repeat_interleave(FP8_BLOCK, 1)[:, :k]
        return (q.weight[start:stop].float() * scale).to(dtype)
    if q.scheme in ("mxfp8", "mxfp4", "nvfp4"):
        block = NV_BLOCK if q.scheme == "nvfp4" else MX_BLOCK
        w = q.weight[start:stop]
        elements = w.float() if q.scheme == "mxfp8" else decode_packed(w)
        scale = q.scale[start:stop].float()
        if q.global_scale is not None:
            scale = scale * q.global_scale
        out = (elements.view(stop - start, -1, block) * scale[..., None]).view(stop - start, -1)
        return out[:, :k].to(dtype)
    raise ValueError(f"unknown quantization scheme {q.scheme!r}")

