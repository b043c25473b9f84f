"""Weight quantization schemes (see docs/architecture.md), in vectorised torch and, on the CPU, native
ops that give the same bits (kernels/csrc/quantize.cpp): one object per scheme (`scheme(name)`), which
turns an [N, K] weight into named parts (`weight`, `weight_scale`, and for nvfp4 `weight_global_scale`)
and back, gives the parts' dtypes and shapes before any data exists (`layout`, for slab planning),
slices a TP shard on its blocks (`narrow`), and names the linear kernels that take it on each device
(kernels/linear.py runs them). What a scheme is without torch is kernels/formats.py.

Conventions: dequantised = element x scale. Block scales run along K (the input dimension); K that
is not a multiple of the block is zero-padded in the stored weight. Non-finite weights are refused
(ValueError); finite values beyond a format's range saturate to its largest magnitude.
"""

import dataclasses

import torch
import torch.nn.functional as F

from kernels.formats import (E2M1_ELEMENTS, E4M3_ELEMENTS, E4M3_PER_BLOCK, E8M0_PER_BLOCK, FP8_BLOCK, INT8_ELEMENTS,
                             PER_BLOCK_2D, PER_ROW, PER_TENSOR, SCHEMES, Format, format_of)
from kernels.fp4 import E2M1_MAX, decode_packed, e2m1_encode, pack

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
E4M3_MAX = 448.0
INT8_MAX = 127.0
QUANTIZE_CHUNK = 1 << 20  # elements of a weight that one pass of quantize() takes on the CPU


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
        return sum(p.numel() * p.element_size() for p in (self.weight, self.scale, self.global_scale) if p is not None)


class Scheme:
    """One quantization format: its parts, quantize and dequantize, and its kernels per device."""

    native: tuple[int, int, int]  # (scale kind, block along K or 0 for a whole row, element) of the native ops
    torch_int8_mm = False  # torch._weight_int8pack_mm multiplies it on CPU (weight-only int8)
    cuda_fp8_mm = False  # torch._scaled_mm multiplies it on CUDA GPUs of SM 8.9 on (W8A8, dynamic activations)
    weight_scale = False  # a scale of the whole weight's largest magnitude (FP8 per tensor, NVFP4's global one)
    row_scale = False  # one scale per row, of all its K (INT8, FP8 per channel)

    def __init__(self, name: str):
        self.format: Format = format_of(name)
        self.name = name

    def __repr__(self) -> str:
        return f"<scheme {self.name}>"

    def native_operands(self, q: "QuantizedWeight") -> tuple | None:
        """(weight, scale, global scale, scale kind, block, element) as the native CPU GEMV takes q,
        or None where it does not: K as stored (padded for MX/NVFP4) not a multiple of 16."""
        if q.weight.shape[1] * self.format.elements_per_byte % 16:
            return None
        return (q.weight, q.scale, q.global_scale, *self.native)

    def layout(self, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{part: (dtype, shape)} of a quantized [n, k] weight."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, amax: torch.Tensor) -> "QuantizedWeight":
        """A finite float32 [N, K] weight (or whole rows of one), quantized in torch; `amax` (float32,
        0-dim) is the whole weight's largest magnitude, for the scales that span it."""
        raise NotImplementedError

    def tensor_scale(self, amax: torch.Tensor) -> torch.Tensor | None:
        """The scale of the whole weight (float32, 0-dim) from its largest magnitude: FP8 per tensor's,
        NVFP4's global scale; None for the other schemes."""
        return None

    def dequantize(self, q: "QuantizedWeight", start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight, float32."""
        raise NotImplementedError

    def narrow_scale(self, scale: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """The scales of rows (dim 0) or columns (dim 1) [start, start + length), on whole blocks."""
        if scale.dim() >= 1 and dim == 0:
            return scale[start:start + length]
        if scale.dim() == 2:  # block scales along K
            block = self.format.block[1]
            return scale[:, start // block:(start + length) // block]
        return scale


class PerRow(Scheme):
    """FP8 with one scale per tensor or per output row, and INT8 with one per row."""

    def __init__(self, name: str, per_row: bool, integer: bool):
        super().__init__(name)
        self.per_row, self.integer = per_row, integer
        self.row_scale, self.weight_scale = per_row, not per_row
        self.element = torch.int8 if integer else E4M3
        self.limit = INT8_MAX if integer else E4M3_MAX
        self.native = (PER_ROW if per_row else PER_TENSOR, 0, INT8_ELEMENTS if integer else E4M3_ELEMENTS)
        self.torch_int8_mm = integer
        self.cuda_fp8_mm = not integer

    def layout(self, n, k):
        return {"weight": (self.element, (n, k)), "weight_scale": (torch.float32, (n,) if self.per_row else ())}

    def tensor_scale(self, amax):
        return None if self.per_row else _scale_of(amax, self.limit)

    def quantize(self, w, amax):
        n, k = w.shape
        # A row's largest magnitude from its least and greatest value (no |w| made; aminmax along rows
        # is not vectorized), and the rounding and clamping in place.
        if self.per_row:  # (rows of no elements: a scale of 1, as a row of zeros)
            rows = torch.maximum(-w.amin(dim=1), w.amax(dim=1)) if k else torch.zeros(n, device=w.device)
            scale = _scale_of(rows, self.limit)
        else:
            scale = self.tensor_scale(amax)
        scaled = w / (scale[:, None] if self.per_row else scale)
        if self.integer:
            q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            q = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return QuantizedWeight(self.name, q, scale, None, (n, k))

    def dequantize(self, q, start, stop):
        scale = q.scale[start:stop, None] if self.per_row else q.scale
        return q.weight[start:stop].float() * scale


class Fp8Block(Scheme):
    """FP8 with one scale per 128x128 block (DeepSeek-V3's format)."""

    native = (PER_BLOCK_2D, FP8_BLOCK, E4M3_ELEMENTS)

    def layout(self, n, k):
        return {"weight": (E4M3, (n, k)), "weight_scale": (torch.float32, (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)))}

    def quantize(self, w, amax):
        n, k = w.shape
        nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        blocks = F.pad(w, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n)).view(nb, FP8_BLOCK, kb, FP8_BLOCK)
        scale = _scale_of(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
        q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return QuantizedWeight(self.name, q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous(), scale, None,
                               (n, k))

    def dequantize(self, q, start, stop):
        k = q.shape[1]
        scale = q.scale.repeat_interleave(FP8_BLOCK, 0)[start:stop].repeat_interleave(FP8_BLOCK, 1)[:, :k]
        return q.weight[start:stop].float() * scale

    def narrow_scale(self, scale, dim, start, length):
        blocks = slice(start // FP8_BLOCK, -(-(start + length) // FP8_BLOCK))
        return scale[blocks] if dim == 0 else scale[:, blocks]


class Microscaled(Scheme):
    """OCP MX (MXFP8, MXFP4: a power-of-two E8M0 scale per 32 elements along K) and NVFP4 (an E4M3
    scale per 16 elements, times one float32 global scale). K is zero-padded to whole blocks."""

    def __init__(self, name: str, fp4: bool, nvidia: bool):
        super().__init__(name)
        self.fp4, self.nvidia = fp4, nvidia
        self.weight_scale = nvidia
        self.block_k = self.format.block[1]
        element = E2M1_ELEMENTS if fp4 else E4M3_ELEMENTS
        self.native = (E4M3_PER_BLOCK if nvidia else E8M0_PER_BLOCK, self.block_k, element)

    def layout(self, n, k):
        kp = -(-k // self.block_k) * self.block_k
        parts = {"weight": (torch.uint8, (n, kp // 2)) if self.fp4 else (E4M3, (n, kp)),
                 "weight_scale": (E4M3 if self.nvidia else E8M0, (n, kp // self.block_k))}
        if self.nvidia:
            parts["weight_global_scale"] = (torch.float32, ())
        return parts

    def tensor_scale(self, amax):
        return _scale_of(amax, E4M3_MAX * E2M1_MAX) if self.nvidia else None

    def quantize(self, w, amax):
        n, k = w.shape
        kp = -(-k // self.block_k) * self.block_k
        blocks = F.pad(w, (0, kp - k)).view(n, kp // self.block_k, self.block_k)
        if self.nvidia:
            block_amax = blocks.abs().amax(dim=-1)  # (amin and amax over blocks this short: 1.5-2x its time)
            global_scale = self.tensor_scale(amax)
            block_scale = (block_amax / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(E4M3)
            total = block_scale.float() * global_scale
            scaled = torch.where(total[..., None] > 0, blocks / total[..., None], torch.zeros_like(blocks))
            return QuantizedWeight(self.name, pack(e2m1_encode(scaled.view(n, kp))), block_scale, global_scale, (n, k))
        # OCP MX: shared exponent = floor(log2(amax)) - emax of the element format (e4m3: 8, e2m1: 2).
        block_amax = blocks.abs().amax(dim=-1)
        _, exponent = torch.frexp(block_amax)
        emax = 2 if self.fp4 else 8
        shared = torch.where(block_amax > 0, exponent - 1 - emax, torch.full_like(exponent, -127))
        shared = shared.clamp(-127, 127)
        scaled = blocks * torch.exp2(-shared.float())[..., None]
        scale = (shared + 127).to(torch.uint8).view(E8M0)
        if self.fp4:
            return QuantizedWeight(self.name, pack(e2m1_encode(scaled.view(n, kp))), scale, None, (n, k))
        return QuantizedWeight(self.name, scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(n, kp), scale, None, (n, k))

    def dequantize(self, q, start, stop):
        w = q.weight[start:stop]
        elements = decode_packed(w) if self.fp4 else w.float()
        scale = q.scale[start:stop].float()
        if q.global_scale is not None:
            scale = scale * q.global_scale
        out = (elements.view(stop - start, -1, self.block_k) * scale[..., None]).view(stop - start, -1)
        return out[:, :q.shape[1]]


def _scale_of(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """amax / limit, or 1 where that is 0 (a zero block, row or weight, or magnitudes below about
    1e-42, whose quotient underflows: dividing by it made NaN codes)."""
    scale = amax / limit
    return torch.where(scale > 0, scale, torch.ones_like(scale))


_SCHEMES = {s.name: s for s in (
    PerRow("fp8_per_tensor", per_row=False, integer=False), PerRow("fp8_per_channel", per_row=True, integer=False),
    Fp8Block("fp8_block"), PerRow("int8", per_row=True, integer=True),
    Microscaled("mxfp8", fp4=False, nvidia=False), Microscaled("mxfp4", fp4=True, nvidia=False),
    Microscaled("nvfp4", fp4=True, nvidia=True))}
assert tuple(_SCHEMES) == SCHEMES


def scheme(name: str) -> Scheme:
    """The scheme object of `name`; ValueError naming the known schemes for any other name."""
    found = _SCHEMES.get(name) if isinstance(name, str) else None
    if found is None:
        format_of(name)  # raises, naming the known schemes
    return found


def layout(name: str, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{part: (dtype, shape)} of an [n, k] weight quantized with scheme `name`."""
    return scheme(name).layout(n, k)


def quantize(w: torch.Tensor, name: str, chunk: int = QUANTIZE_CHUNK,
             out: dict[str, torch.Tensor] | None = None) -> QuantizedWeight:
    """w ([N, K], any float dtype), quantized with scheme `name`. `out` ({part: tensor} of the scheme's
    layout, e.g. a slab's bytes) receives the parts if given, and is then what the result holds. On the
    CPU the native op (kernels/csrc/quantize.cpp) quantizes it in one pass where the library runs; in
    torch, a weight of more than `chunk` elements is quantized a few whole rows (of the scheme's blocks)
    at a time, through float32 temporaries of about `chunk` elements. Every path gives the same bits."""
    _check_2d(w)
    return _quantize(w, scheme(name), None, chunk, out)


def quantize_part(w: torch.Tensor, name: str, dim: int, start: int, length: int,
                  chunk: int = QUANTIZE_CHUNK, out: dict[str, torch.Tensor] | None = None) -> QuantizedWeight:
    """narrow(quantize(w, name), dim, start, length), the same bits, for a TP rank's shard: only the
    slice is quantized, with the whole weight's largest magnitude for the scales that span it,
    except a slice along K of a scheme with one scale per row (whose scales are whole rows')."""
    found = scheme(name)
    amax = _largest_magnitude(w)  # the whole weight's non-finite values refused, as quantize refuses them
    if dim == 1 and found.row_scale:
        return _into(narrow(_quantize(w, found, amax, chunk, None), dim, start, length), out)
    _check_slice(found, tuple(w.shape), dim, start, length)
    return _quantize(w.narrow(dim, start, length), found, amax, chunk, out)


def _largest_magnitude(w: torch.Tensor) -> torch.Tensor:
    """The largest |value| of a 2-D weight (float32, 0-dim); ValueError if any value is not finite."""
    _check_2d(w)
    if not w.numel():
        return torch.zeros((), device=w.device)
    # One pass that keeps nothing: the least and greatest value are finite only if every value is (a
    # NaN anywhere makes both NaN), and they give the largest magnitude, finite in float32 too.
    least, greatest = torch.aminmax(w)
    if not bool(torch.isfinite(amax := torch.maximum(-least, greatest).float())):
        refuse_non_finite(w)
    return amax


def _check_2d(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"quantization needs a 2-D weight, got shape {list(w.shape)}")


def refuse_non_finite(w: torch.Tensor):  # a weight not all finite in float32, which quantization computes in
    if bad := int((~torch.isfinite(w)).sum()):
        raise ValueError(f"weight has {bad} non-finite value(s) (inf/nan); refusing to quantize it")
    raise ValueError(f"weight has values beyond float32's range (largest magnitude {float(w.abs().max()):.3g}), which "
                     "quantization computes in; refusing to quantize it: store it as float32 or bfloat16, in range")


def _quantize(w: torch.Tensor, found: Scheme, amax: torch.Tensor | None, chunk: int,
              out: dict[str, torch.Tensor] | None) -> QuantizedWeight:
    """w quantized; `amax` is its largest magnitude (or the whole weight's, for a part of it), found
    here where None and needed: the native op finds non-finite values itself, so it needs one only for
    a scale that spans the weight."""
    n, k = w.shape
    native = _native(w, *(out or {}).values())
    if amax is None and (native is None or found.weight_scale):
        amax = _largest_magnitude(w)
    if native is not None:
        parts = out if out is not None else _empty_parts(found, n, k)
        source = w if w.dtype in (torch.float32, torch.bfloat16, torch.float16) and (k <= 1 or w.stride(1) == 1) \
            else w.float().contiguous()
        scale = found.tensor_scale(amax) if found.weight_scale else None
        if not native.quantize(source, *found.native, 1.0 if scale is None else float(scale), parts["weight"],
                               parts["weight_scale"], native.variant_index()):
            refuse_non_finite(w)
        if scale is not None:  # FP8 per tensor's scale, or NVFP4's global one
            parts["weight_global_scale" if "weight_global_scale" in parts else "weight_scale"].copy_(scale)
        return _result(found, parts, n, k)
    block = found.format.block[0]
    step = max(block, chunk // max(k, 1) // block * block)
    if step >= n or w.device.type != "cpu":
        return _into(found.quantize(w.float().contiguous(), amax), out)
    # Each pass's temporaries stay in the caches, and in memory the allocator already has: a whole
    # 11008x4096 bfloat16 weight made 0.4-0.9 GB of them and took 2-4x as long (docs/architecture.md).
    parts = out if out is not None else _empty_parts(found, n, k)
    for start in range(0, n, step):
        length = min(step, n - start)
        q = found.quantize(w[start:start + length].float().contiguous(), amax)
        parts["weight"][start:start + length].copy_(q.weight)
        found.narrow_scale(parts["weight_scale"], 0, start, length).copy_(q.scale)
        if q.global_scale is not None:
            parts["weight_global_scale"].copy_(q.global_scale)
    return _result(found, parts, n, k)


def _native(*tensors: torch.Tensor):
    """kernels.native where its quantize ops take `tensors` (CPU, a native variant), else None."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    from kernels import native  # on first use: a process that never quantizes never loads the library
    return native if native.quantize is not None else None


def quantize_many(source: torch.Tensor, dtype: torch.dtype, weights: list[int], dest: torch.Tensor, name: str) -> int:
    """Small weights of scheme `name` stored as `dtype` in `source` quantized into `dest` (uint8) as quantize() would,
    in one native call on this thread (`weights`: 8 ints each, quantize.cpp): the first non-finite one's index or -1."""
    native = _native()
    if native is None:
        raise RuntimeError("quantize_many runs on the native kernels only (see many_native())")
    return native.quantize_many(source, dtype, weights, dest, *scheme(name).native, native.variant_index())


def many_native() -> bool:
    return _native() is not None


def _empty_parts(found: Scheme, n: int, k: int) -> dict[str, torch.Tensor]:
    return {part: torch.empty(shape, dtype=dtype) for part, (dtype, shape) in found.layout(n, k).items()}


def _result(found: Scheme, parts: dict[str, torch.Tensor], n: int, k: int) -> QuantizedWeight:
    return QuantizedWeight(found.name, parts["weight"], parts["weight_scale"], parts.get("weight_global_scale"), (n, k))


def _into(q: QuantizedWeight, out: dict[str, torch.Tensor] | None) -> QuantizedWeight:
    """q, its parts copied into `out` (and then held there) if given."""
    if out is None:
        return q
    out["weight"].copy_(q.weight)
    out["weight_scale"].copy_(q.scale)
    if q.global_scale is not None:
        out["weight_global_scale"].copy_(q.global_scale)
    return _result(scheme(q.scheme), out, *q.shape)


def narrow(q: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight:
    """Rows (dim 0) or input columns (dim 1) [start, start + length) of a quantized weight, as the
    parts a quantization of that slice alone would have if it used the whole weight's scales: the
    slice must fall on the scheme's block boundaries (128 for fp8_block, 32 for MX, 16 for NVFP4)."""
    n, k = q.shape
    found = scheme(q.scheme)
    _check_slice(found, q.shape, dim, start, length)
    if start == 0 and length == q.shape[dim]:
        return q
    packed = found.format.elements_per_byte
    weight = q.weight[start:start + length] if dim == 0 else q.weight[:, start // packed:(start + length) // packed]
    scale = found.narrow_scale(q.scale, dim, start, length)
    shape = (length, k) if dim == 0 else (n, length)
    return QuantizedWeight(q.scheme, weight.contiguous(), scale.contiguous(), q.global_scale, shape)


def _check_slice(found: Scheme, shape: tuple[int, int], dim: int, start: int, length: int) -> None:
    if dim not in (0, 1) or not (0 <= start and length > 0 and start + length <= shape[dim]):
        raise ValueError(f"bad slice [{start}, {start + length}) of dim {dim} of a {list(shape)} weight")
    block = found.format.block[dim]
    if (start % block or length % block) and not (start == 0 and length == shape[dim]):
        raise ValueError(f"slice [{start}, {start + length}) of dim {dim} does not fall on {found.name}'s "
                         f"{block}-element blocks")


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
    """The [N, K] weight (or the `rows` slice of it) in `dtype`."""
    start, stop, _ = rows.indices(q.shape[0])
    return scheme(q.scheme).dequantize(q, start, stop).to(dtype)
