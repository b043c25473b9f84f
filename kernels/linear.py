"""Linear layers over plain or quantized weights.

CPU: the native kernels where they were built and this CPU runs them (kernels/native.py picks the
variant): a fused dequantize-and-multiply GEMV for up to a few activation rows, and dequantized
cache-sized tiles fed to torch's GEMM for more. int8 takes torch's own fused weight-only int8
kernel wherever the native kernels are missing.
Without them, the weight is dequantized in row tiles that stay in cache and each tile is
multiplied, or dequantized once per call when the activation has many rows (prefill). GPU: FP8
per-tensor and per-channel use torch._scaled_mm on SM89+ with dynamically quantized activations;
everything else dequantizes and multiplies."""

import torch
import torch.nn.functional as F

from kernels import native
from kernels.quant import E4M3, E4M3_MAX, QuantizedWeight, Scheme, dequantize, scheme

TILE_BYTES = 1 << 20  # a dequantized tile this size stays in L2 while it is multiplied
LARGE_M = 64          # from this many activation rows on, one full dequantization is cheaper
# Most activation rows the fused GEMV takes before dequantized tiles + torch's GEMM win, on every
# variant. Measured on AVX2 (2 cores): the GEMV beats both torch's int8 kernel and the tiles up to 16
# rows (about even to 32), and the tiles beat torch's int8 kernel above. On a 2-core Xeon with AMX
# running the avx512 variant, the GEMV in passes of 4 rows beat the bf16 tiles up to 16 rows as well
# (M=8: 1.3-1.8x bf16's time against 2.4-3.9x through the tiles), and was about even with torch's
# int8 kernel (0.9-1.2x); on a 2-core Zen 5 running the avx512 variant it took 0.55-0.8x of that
# kernel's time at 1-16 rows from memory (4096x4096, M=1: 456 against 576 us). On amx the GEMV's
# tiles beat torch's int8 kernel at every row count (4096x4096: M=1 0.35 against 0.45 ms, M=8 0.59
# against 1.53 ms), and on avx512bf16 (Zen 5) the GEMV on the bfloat16 dot product does (M=1: 0.18
# against 0.22 ms in cache; one to four rows have since moved to its integer multiply-adds, faster
# still on a Zen 4). So int8 runs the native kernels wherever they are built.
GEMV_MAX_M = 16
# torch's int8 kernel (torch 2.13, CPU) reads past a bfloat16 row whose K is no multiple of 16: wrong
# sums at 3 rows of x and K = 40, a segfault at 20 (a checkpoint with hidden size 40, or a TP rank's
# down projection of K = 520). Such weights take the dequantizing path.
TORCH_INT8_K = 16


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    out = quantized_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return out + bias if bias is not None else out


def quantized_linear(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (float32/bfloat16/float16) @ dequantize(q).T -> [M, N] in x.dtype."""
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"activation has K={x.shape[-1]}, weight expects K={q.shape[1]}")
    found = scheme(q.scheme)
    if x.device.type == "cpu":
        out = _cpu_kernel(x, q, found)
        if out is not None:
            return out
    elif x.is_cuda and found.cuda_fp8_mm and _has_fp8_mma(x.device):
        return _scaled_mm_fp8(x, q)
    if x.shape[0] >= LARGE_M:
        return F.linear(x, dequantize(q, x.dtype))
    n, k = q.shape
    rows = max(128, TILE_BYTES // (k * x.element_size()) // 128 * 128)
    if rows >= n:
        return F.linear(x, dequantize(q, x.dtype))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        torch.matmul(x, dequantize(q, x.dtype, slice(start, stop)).T, out=out[:, start:stop])
    return out


def _cpu_kernel(x: torch.Tensor, q: QuantizedWeight, found: Scheme) -> torch.Tensor | None:
    """The fastest fused CPU kernel for x and q, or None where the pure torch path is all there is."""
    if native.qgemv is not None:
        out = _native(x, q, found)
        if out is not None:
            return out
    if found.torch_int8_mm and q.shape[1] % TORCH_INT8_K == 0 and (x.shape[0] < LARGE_M or native.qgemm is None):
        return torch._weight_int8pack_mm(x, q.weight, q.scale.to(x.dtype))
    return None


def _native(x: torch.Tensor, q: QuantizedWeight, found: Scheme) -> torch.Tensor | None:
    """The native kernels, or None for what they do not take (K not a multiple of 16, other dtypes)."""
    operands = found.native_operands(q)
    if x.dtype not in (torch.float32, torch.bfloat16) or operands is None:
        return None
    op = native.qgemv if x.shape[0] <= GEMV_MAX_M else native.qgemm
    return op(x, *operands)


def reference_linear(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """Dequantize everything in float32, multiply, cast back."""
    return (x.float() @ dequantize(q, torch.float32).T).to(x.dtype)


def _has_fp8_mma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_fp8(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """W8A8 on tensor cores: per-row dynamic activation scales, the weight's own scales."""
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
    xq = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    w_scale = q.scale.float().expand(q.shape[0]).reshape(1, -1)
    return torch._scaled_mm(xq, q.weight.T, scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
