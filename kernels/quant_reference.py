"""Readable scalar reference implementations of the quantization schemes, written from the
format definitions (not from the vectorised code): every grid value is enumerated and each element
rounds to the nearest one, ties to the even code. Slow; for tests on small tensors only."""

import math

import torch

from kernels.quant import QuantizedWeight


def _grid(dtype: torch.dtype) -> list[tuple[float, int]]:
    """(value, code) of every finite non-negative value of an 8-bit float format."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float().tolist()
    return sorted((v, c) for c, v in enumerate(values) if math.isfinite(v) and v >= 0 and not (v == 0 and c))


E4M3_GRID = _grid(torch.float8_e4m3fn)
E2M1_GRID = [(v, c) for c, v in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))]


def round_to_grid(x: float, grid: list[tuple[float, int]]) -> tuple[float, int]:
    """Nearest grid value to |x| (saturating), ties to the even code; returns (value, code)."""
    a = abs(x)
    if a >= grid[-1][0]:
        return grid[-1]
    for (lo, lo_code), (hi, hi_code) in zip(grid, grid[1:]):
        if lo <= a <= hi:
            if a - lo < hi - a or (a - lo == hi - a and lo_code % 2 == 0):
                return lo, lo_code
            return hi, hi_code
    raise AssertionError("unreachable: the grid starts at 0")


def e2m1_code(x: float) -> int:
    _, code = round_to_grid(x, E2M1_GRID)
    return code | (8 if math.copysign(1.0, x) < 0 else 0)


def e4m3(x: float) -> float:
    value, _ = round_to_grid(x, E4M3_GRID)
    return math.copysign(value, x)


def _scale(amax: float, limit: float) -> float:
    """amax / limit in float32, or 1 where that is 0 (amax 0, or so small that the quotient underflows)."""
    s = float(torch.tensor(amax, dtype=torch.float32) / limit)
    return s if s > 0 else 1.0


def quantize_reference(w: torch.Tensor, scheme: str) -> dict:
    """{"weight": nested lists of stored element values or codes, "scale": ..., "global_scale": ...}."""
    rows = w.double().tolist()
    n, k = len(rows), len(rows[0])
    if scheme in ("fp8_per_tensor", "fp8_per_channel", "int8"):
        limit = 127.0 if scheme == "int8" else 448.0
        amax_all = max(abs(v) for r in rows for v in r)
        scales = []
        out = []
        for r in rows:
            amax = amax_all if scheme == "fp8_per_tensor" else max(abs(v) for v in r)
            s = _scale(amax, limit)
            scales.append(s)
            if scheme == "int8":
                out.append([max(-127, min(127, round(float(torch.tensor(v, dtype=torch.float32) / s)))) for v in r])
            else:
                out.append([e4m3(float(torch.tensor(v, dtype=torch.float32) / s)) for v in r])
        return {"weight": out, "scale": scales[0] if scheme == "fp8_per_tensor" else scales}
    if scheme == "fp8_block":
        out = [[0.0] * k for _ in range(n)]
        scales = []
        for bi in range(0, n, 128):
            row_scales = []
            for bk in range(0, k, 128):
                cells = [(i, j) for i in range(bi, min(bi + 128, n)) for j in range(bk, min(bk + 128, k))]
                amax = max(abs(rows[i][j]) for i, j in cells)
                s = _scale(amax, 448.0)
                row_scales.append(s)
                for i, j in cells:
                    out[i][j] = e4m3(float(torch.tensor(rows[i][j], dtype=torch.float32) / s))
            scales.append(row_scales)
        return {"weight": out, "scale": scales}
    if scheme in ("mxfp8", "mxfp4"):
        emax = 8 if scheme == "mxfp8" else 2
        codes, exps = [], []
        for r in rows:
            r = r + [0.0] * (-k % 32)
            row_codes, row_exps = [], []
            for b in range(0, len(r), 32):
                block = r[b:b + 32]
                amax = max(abs(v) for v in block)
                e = max(-127, min(127, math.floor(math.log2(amax)) - emax)) if amax > 0 else -127
                row_exps.append(e + 127)
                for v in block:
                    scaled = v / 2.0 ** e
                    row_codes.append(e4m3(scaled) if scheme == "mxfp8" else e2m1_code(scaled))
            codes.append(row_codes)
            exps.append(row_exps)
        return {"weight": codes, "scale": exps}
    if scheme == "nvfp4":
        amax_all = float(torch.tensor(max(abs(v) for r in rows for v in r), dtype=torch.float32))
        g = _scale(amax_all, 448.0 * 6.0)
        codes, scales = [], []
        for r in rows:
            r = r + [0.0] * (-k % 16)
            row_codes, row_scales = [], []
            for b in range(0, len(r), 16):
                block = r[b:b + 16]
                bs = e4m3(min(448.0, float(torch.tensor(max(abs(v) for v in block), dtype=torch.float32) / 6.0 / g)))
                row_scales.append(bs)
                total = float(torch.tensor(bs, dtype=torch.float32) * torch.tensor(g, dtype=torch.float32))
                row_codes += [e2m1_code(float(torch.tensor(v, dtype=torch.float32) / total)) if total > 0 else 0
                              for v in block]
            codes.append(row_codes)
            scales.append(row_scales)
        return {"weight": codes, "scale": scales, "global_scale": g}
    raise ValueError(f"no reference for {scheme!r}")


def stored(q: QuantizedWeight) -> dict:
    """The kernel's result in the reference's terms (element values or codes, scales as numbers)."""
    from kernels.fp4 import unpack
    if q.scheme in ("fp8_per_tensor", "fp8_per_channel", "int8", "fp8_block"):
        weight = q.weight.float().tolist()
        scale = q.scale.item() if q.scale.dim() == 0 else q.scale.tolist()
        return {"weight": weight, "scale": scale}
    if q.scheme == "mxfp8":
        return {"weight": q.weight.float().tolist(), "scale": q.scale.view(torch.uint8).int().tolist()}
    if q.scheme == "mxfp4":
        return {"weight": unpack(q.weight).int().tolist(), "scale": q.scale.view(torch.uint8).int().tolist()}
    if q.scheme == "nvfp4":
        return {"weight": unpack(q.weight).int().tolist(), "scale": q.scale.float().tolist(),
                "global_scale": q.global_scale.item()}
    raise ValueError(q.scheme)
