"""FP4 E2M1 (OCP MX): 1 sign, 2 exponent, 1 mantissa bit; codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6
and 8-15 their negatives. Rounding is to nearest, ties to even (to the code with mantissa bit 0);
magnitudes above 6 saturate to 6. Two codes pack into a byte, the first element in the low nibble."""

import functools

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Midpoints between neighbouring magnitudes; at a tie the even code wins, hence > or >= alternating.
_UP_AT = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 codes (0-15). Finite inputs only."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in _UP_AT:
        code += (a >= threshold) if inclusive else (a > threshold)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    magnitude = values[(code & 7).long()]
    return torch.where((code & 8).bool(), -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2m] codes -> [..., m] bytes."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 2m] codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


@functools.cache
def _pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2] on `device`: both values of every packed byte, for decoding a whole byte with one
    lookup. Built on first use, not at import: importing the kernels runs no tensor code."""
    return e2m1_decode(unpack(torch.arange(256, dtype=torch.uint8)).view(256, 2)).to(dtype=dtype, device=device)


def decode_packed(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., m] bytes -> [..., 2m] values in `dtype` (one table lookup per byte)."""
    return _pairs(dtype, packed.device)[packed.long()].flatten(-2)
