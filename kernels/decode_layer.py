"""A whole decoder layer of a decode step in one native call (kernels/csrc/layer.cpp): norm, q/k/v,
rope, the cache write, attention, o, residual, norm, gate/up, SwiGLU, down and residual, for every
sequence of the batch at once, without the Python, dispatch and thread wake-ups between the ~25
operations of a layer. It runs the fused GEMV of kernels/csrc for every product and rounds where
torch rounds; where the per-op path picks the same GEMV (one row; a few rows of bfloat16 on CPUs
without bfloat16 matrix units; quantized weights, int8 included, up to kernels/linear.py's GEMV
limit) a bfloat16 model gets the same bits, elsewhere values
equal up to rounding. Batches of more than `FusedLayers.max_rows` rows run op by op (the GEMM paths
win there).

`fused_layer(...)` builds one over a layer's weights, or says why it cannot (a weight the native
GEMV does not take, no native kernels); `FusedLayer.__call__` runs it on the variant in use, and
`FusedLayers` runs a model's layers in order in one call (a call per layer costs tens of
microseconds each on a small model: the interpreter's code comes back from memory every time)."""

import torch

from kernels import native
from kernels.dense import UNIT_SCALE, reduced_gemm_is_slow
from kernels.formats import BF16_ELEMENTS, PER_TENSOR
from kernels.quant import QuantizedWeight, scheme

PHASES = ("qkv", "o", "gate_up", "down")
MAX_ROWS = 16
"""Most sequences a fused step takes: the fused GEMV reads the weight once per pass of up to 8 rows
on AVX2 (4 where 8 rows of float32 x outgrow L1) and AVX512-BF16 (4 on AVX-512 without it, and for
float32 activations; 16 on AMX's tiles); past kernels/linear.py's GEMV limit the per-op path's GEMM
paths are faster."""
MATRIX_UNIT_ROWS = 8
"""Most sequences a fused step of plain bfloat16 weights takes where torch's bfloat16 GEMM runs on
matrix units (AMX, AVX512-BF16) and the fused GEMV does not (avx512 or avx2 there): past it
that GEMM is faster (the default model on a 2-core Xeon with AMX, a decode step of 16 sequences: 38
ms op by op, 47 ms fused on avx512; of 8: 35 and 34 ms). On amx the fused step wins at 16 as well
(33 against 44 ms), and on avx512bf16 (a 2-core Zen 5: 21 against 21-27 ms)."""
BFLOAT16_UNIT_VARIANTS = ("amx", "avx512bf16")
"""The variants whose fused GEMV multiplies bfloat16 activations on the CPU's bfloat16 units."""


def max_rows(plain: bool) -> int:
    """Most sequences a fused step takes on the variant in use: `plain`, for plain bfloat16 layers."""
    slow_gemm = reduced_gemm_is_slow(torch.device("cpu"))
    return MATRIX_UNIT_ROWS if plain and not slow_gemm and native.VARIANT not in BFLOAT16_UNIT_VARIANTS else MAX_ROWS


class FusedLayer:
    """One decoder layer's native decode step (see the module docstring); `plain`: its weights are
    all plain bfloat16."""

    def __init__(self, layer, plain: bool):
        self._layer = layer
        self.plain = plain

    def __call__(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
        """x [B, hidden]; cache: this layer's [slots, 2, KV, max_len, D]; slots and lengths int64 [B]
        (each row's new token sits at lengths - 1 of its slot); rope [B, 1, 2, D]: rope_table rows
        of the new positions. Writes the new keys and values and returns the layer's output."""
        return self._layer.forward(x, cache, slots, lengths, rope, native.variant_index())


class FusedLayers:
    """A model's fused layers, each decode step over all of them in one native call; batches of more
    than `max_rows` sequences run op by op."""

    def __init__(self, layers: list[FusedLayer]):
        self.layers = layers
        self.plain = any(layer.plain for layer in layers)
        self._stack = torch.classes.preload.DecodeStack()
        for layer in layers:
            self._stack.append(layer._layer)

    @property
    def max_rows(self) -> int:
        return max_rows(self.plain)

    def __len__(self) -> int:
        return len(self.layers)

    def __call__(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
        """FusedLayer.__call__ through every layer, cache the whole [layers, slots, 2, KV, max_len, D]."""
        return self._stack.forward(x, cache, slots, lengths, rope, native.variant_index())


def _parts(w) -> tuple | str:
    """(weight, scale, global scale, scale kind, block, element) as the native GEMV takes `w`, or why not."""
    if isinstance(w, QuantizedWeight):
        operands = scheme(w.scheme).native_operands(w)
        return operands or f"a {w.scheme} weight whose stored width is not a multiple of 16 elements"
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous() \
            or w.shape[1] % 16:
        return "a plain weight that is not a contiguous bfloat16 [N, K] with K a multiple of 16"
    return w, UNIT_SCALE, None, PER_TENSOR, 0, BF16_ELEMENTS


def fused_layer(*, projections: dict, norms: tuple, biases: dict, heads: int, kv_heads: int, head_dim: int,
                eps: float) -> FusedLayer | str:
    """The fused layer over `projections` ({"q", "k", "v", "o", "gate", "up", "down": weight}),
    `norms` (input, post-attention, q or None, k or None) and `biases` ({"q", "k", "v", "o": tensor or
    None}); or a string saying why it cannot run here."""
    if native.variant_index() < 0:
        return "no native kernels are chosen here"
    dtype = norms[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or norms[0].device.type != "cpu":
        return f"a {dtype} model (the fused layer runs float32 and bfloat16 on CPU)"
    hidden, intermediate = norms[0].shape[0], projections["gate"].shape[0]
    layer = torch.classes.preload.DecodeLayer(hidden, heads, kv_heads, head_dim, intermediate, eps, head_dim ** -0.5)
    for phase, names in enumerate((("q", "k", "v"), ("o",), ("gate", "up"), ("down",))):
        for name in names:
            parts = _parts(projections[name])
            if isinstance(parts, str):
                return parts
            try:
                layer.add(phase, *parts)
            except RuntimeError as e:  # shapes or formats the op refuses: the per-op path runs them
                return f"the {name} projection: {e}"
    qkv = [biases.get(n) for n in ("q", "k", "v")]
    if any(b is not None for b in qkv):
        widths = [projections[n].shape[0] for n in ("q", "k", "v")]
        qkv_bias = torch.cat([b if b is not None else torch.zeros(n, dtype=dtype) for b, n in zip(qkv, widths)])
    else:
        qkv_bias = None
    try:
        layer.norms(*norms)
        layer.biases(qkv_bias, biases.get("o"))
    except RuntimeError as e:
        return f"the norms or biases: {e}"
    return FusedLayer(layer, plain=not any(isinstance(w, QuantizedWeight) for w in projections.values()))
