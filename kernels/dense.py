"""Products with plain (unquantized) weights, on the fastest path there is for the shape and CPU.

One activation row (a decode step) runs the native fused GEMV of kernels/csrc with its bfloat16
element format where those kernels are built: it prefetches each weight row ahead of its reads and
streams the weight from memory about 1.5-2x faster than torch's bfloat16 GEMV (a 2-core AVX2 Zen 1
VM: 11-15 GB/s against 6-9). A few rows (up to `native_rows()`, measured per variant and CPU) take
the same kernel, which streams the weight once for all the rows:
- where torch's bfloat16 GEMM is slow (torch's reference GEMM: no oneDNN bfloat16 on CPUs without
  AVX-512), 8, far faster than the widened tiles below (2.5-4x on AVX2 CPUs; the avx512 kernels in
  two passes of 4 rows 4-7x at 6 and 8 rows, a 2-core Zen 4);
- where oneDNN runs it without AMX tiles, 8 on every variant: on avx512bf16's bfloat16 dot product
  (a 2-core Zen 5, 49152x576 from memory: 0.4x oneDNN's time at 1 to 8 rows, 0.6-0.7x at 12 and 16,
  which take two passes), and on the avx2 and avx512 kernels (a 2-core Zen 4 whose oneDNN has
  AVX512-BF16, 49152x576 from memory, medians of 21: avx2 2.0-3.0 ms against oneDNN's 3.8-5.6 at 4
  to 8 rows, 0.46-0.54x its time, avx512 2.1-3.0 against 4.2-5.6, 0.51-0.58x; at 12 and 16 rows, two
  passes, 0.71-0.92x, left to oneDNN). Those two took 2 and 4 rows until their 8-row passes caught
  up, and 8 requests' lm_head had run on oneDNN (docs/benchmarks.md). Where 8 rows of float32 x
  outgrow L1 (K of 2048 and 4096), avx2 takes them in two passes of 4 and 8 rows took 1.06-1.12x
  oneDNN's time there (6 rows 0.86-0.89x, avx512 at 8 0.76-0.85x): left so, as the fused decode
  layer's plain products run the same passes. Not measured on AVX-512 CPUs without AVX512-BF16,
  where oneDNN converts to float32;
- where oneDNN runs it on AMX tiles, one on the avx2 and avx512 kernels, 8 on avx512bf16's, and on
  the amx kernels 16, the most their tiles take (a 2-core Emerald Rapids, 49152x576 from memory at 1
  to 8 rows: 0.58-0.64x oneDNN's time; at 16 0.74x, in cache even).
More rows, or no native kernels, on a CPU without those instructions meet torch's reference GEMM, a dot
product per output at ~8 GFLOP/s a core; they widen the weight to float32 in tiles that stay in
cache and run float32 GEMM on each (1.5-2x faster than torch at 8 rows; MKL's float32 GEMM
reaches only 20-40 GFLOP/s a core at 8 rows there): the weight is still read once. Results are
rounded to the input dtype as the reference rounds them, but the float32 sums run in another
order, so a few differ in the last bit. `exact` keeps torch's own kernel for several rows (one
sequence's prefill), whose rows equal its GEMV's bit for bit; without native kernels one row is
torch's GEMV too."""

import functools

import torch
import torch.nn.functional as F

from kernels import native
from kernels.formats import BF16_ELEMENTS, PER_TENSOR

TILE_BYTES = 2 << 20  # a widened tile this size stays in cache while it is multiplied (measured best)
REDUCED = (torch.bfloat16, torch.float16)
# variant -> most rows for the native GEMV where torch's bfloat16 GEMM is slow, where oneDNN runs it
# without AMX tiles, where it runs on them (measured; see above).
_NATIVE_ROWS = {"avx2": (8, 8, 1), "avx512": (8, 8, 1), "avx512bf16": (8, 8, 8), "amx": (16, 16, 16)}
UNIT_SCALE = torch.ones(())  # the per-tensor scale of an unquantized weight in the native GEMV


def native_rows() -> int:
    """Most activation rows the native bfloat16 GEMV takes (0: not built, or not chosen here)."""
    slow, dot, tiles = _NATIVE_ROWS.get(native.VARIANT, (0, 0, 0))
    return slow if reduced_gemm_is_slow(torch.device("cpu")) else tiles if torch_gemm_on_tiles() else dot


@functools.cache
def torch_gemm_on_tiles() -> bool:
    """Whether torch's bfloat16 GEMM runs on AMX tiles here (oneDNN uses them where the CPU has them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe()) and not reduced_gemm_is_slow(torch.device("cpu"))


@functools.cache  # asked at every decode step (kernels/decode_layer.max_rows); the answer never changes
def reduced_gemm_is_slow(device: torch.device) -> bool:
    """Whether torch multiplies reduced-precision matrices (more than one row) slowly on `device`."""
    return device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Dense:
    """x @ w.T for plain weights, with a widening scratch buffer reused across calls (one per model:
    a model runs one forward at a time)."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.widen = reduced_gemm_is_slow(device)
        self._scratch = None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 exact: bool = False) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if w.dtype not in REDUCED or (rows > 1 and exact):
            return F.linear(x, w, bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows <= native_rows() and x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" \
                and w.is_contiguous() and w.shape[1] % 16 == 0:
            out = native.qgemv(x2, w, UNIT_SCALE, None, PER_TENSOR, 0, BF16_ELEMENTS)
        elif rows == 1 or not self.widen:
            return F.linear(x, w, bias)
        else:
            out = widened_linear(x2, w, self._buffer(w.shape))
        out = out.view(*x.shape[:-1], w.shape[0])
        return out + bias if bias is not None else out

    def _buffer(self, shape) -> torch.Tensor:
        elements = min(shape[0], max(1, TILE_BYTES // 4 // shape[1])) * shape[1]
        if self._scratch is None or self._scratch.numel() < elements:
            self._scratch = torch.empty(max(elements, TILE_BYTES // 4))
        return self._scratch


def widened_linear(x: torch.Tensor, w: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T ([N, K], reduced precision), widening row tiles of w into `scratch` (float32)."""
    n, k = w.shape
    tile = min(n, scratch.numel() // k)
    xf = x.float()
    out = torch.empty(x.shape[0], n)
    for start in range(0, n, tile):
        stop = min(start + tile, n)
        widened = scratch[:(stop - start) * k].view(stop - start, k)
        widened.copy_(w[start:stop])
        torch.mm(xf, widened.t(), out=out[:, start:stop])
    return out.to(x.dtype)
