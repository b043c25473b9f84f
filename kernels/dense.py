"""Products with plain (unquantized) weights, on the fastest path torch has for the shape and CPU.

One activation row runs torch's bfloat16/float16 GEMV, which streams the weight once. More rows on a
CPU without bfloat16 matrix instructions (no AVX512-BF16 or AMX) meet torch's reference GEMM, a dot
product per output at ~8 GFLOP/s a core; unless the caller asks for exactly torch's result, they
widen the weight to float32 in tiles that stay in cache and run float32 GEMM on each (1.5-2x faster
at 8 rows on a 2-core AVX2 EPYC; MKL's float32 GEMM reaches only 20-40 GFLOP/s a core at 8 rows
there): the weight is still read once. Results are rounded to the input dtype as the reference
rounds them, but the float32 sums run in another order, so a few differ in the last bit. (The
reference GEMM's rows equal its GEMV's bit for bit; that is what `exact` keeps.)"""

import torch
import torch.nn.functional as F

TILE_BYTES = 2 << 20  # a widened tile this size stays in cache while it is multiplied (measured best)
REDUCED = (torch.bfloat16, torch.float16)


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
        if exact or rows == 1 or not self.widen or w.dtype not in REDUCED:
            return F.linear(x, w, bias)
        out = widened_linear(x.reshape(rows, x.shape[-1]), w, self._buffer(w.shape)).view(*x.shape[:-1], w.shape[0])
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
