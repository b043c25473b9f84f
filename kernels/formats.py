"""The names and block sizes of the quantization schemes, apart from their code so that layers
that only need the names (argument parsing, layout checks) need not import torch."""

FP8_BLOCK = 128
MX_BLOCK = 32
NV_BLOCK = 16
SCHEMES = ("fp8_per_tensor", "fp8_per_channel", "fp8_block", "int8", "mxfp8", "mxfp4", "nvfp4")
# (rows, columns) a slice of a quantized weight must fall on to keep whole blocks.
BLOCKS = {"fp8_block": (FP8_BLOCK, FP8_BLOCK), "mxfp8": (1, MX_BLOCK), "mxfp4": (1, MX_BLOCK), "nvfp4": (1, NV_BLOCK)}
