"""What each quantization scheme is, apart from its code, so that layers that only need this
(argument parsing, TP checks, the manifest) need not import torch. The code of each scheme
(layout, quantize, dequantize, narrow, its linear kernels) is its object in kernels/quant.py."""

import dataclasses

FP8_BLOCK = 128
MX_BLOCK = 32
NV_BLOCK = 16
# How the native CPU GEMV (kernels/csrc/qgemv_kernels.h) reads a weight: its elements (enum Element;
# BF16_ELEMENTS takes a per-tensor scale of 1) and its scales (enum ScaleKind).
E4M3_ELEMENTS, E2M1_ELEMENTS, INT8_ELEMENTS, BF16_ELEMENTS = 0, 1, 2, 3
PER_TENSOR, PER_ROW, PER_BLOCK_2D, E8M0_PER_BLOCK, E4M3_PER_BLOCK = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True, slots=True)
class Format:
    name: str
    block: tuple[int, int] = (1, 1)
    """(rows, columns) a slice of a quantized weight must fall on to keep whole blocks (TP shards)."""
    params: tuple[tuple[str, str], ...] = ()
    """What the manifest and the cache key record of the scheme besides its name."""
    elements_per_byte: int = 1
    """Stored elements per byte along K (2 for the packed FP4 formats)."""


FORMATS = {f.name: f for f in (
    Format("fp8_per_tensor"),
    Format("fp8_per_channel"),
    Format("fp8_block", (FP8_BLOCK, FP8_BLOCK), (("block", "128x128"),)),
    Format("int8"),
    Format("mxfp8", (1, MX_BLOCK), (("block", "32"),)),
    Format("mxfp4", (1, MX_BLOCK), (("block", "32"),), elements_per_byte=2),
    Format("nvfp4", (1, NV_BLOCK), (("block", "16"),), elements_per_byte=2),
)}
SCHEMES = tuple(FORMATS)


def format_of(scheme: str) -> Format:
    """The scheme's description; ValueError naming the known schemes for any other name."""
    try:
        return FORMATS[scheme]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}") from None
