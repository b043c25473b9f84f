"""The native op that quantizes many small weights in one call (kernels.quant.quantize_many, which a
cold load runs on runs of small tensors) against quantize(), and its refusals."""

import pytest
import torch

from kernels import native, quant
from kernels.quant import SCHEMES, quantize

FILL = 0xA5  # what the destination holds before: bytes outside the parts must keep it


@pytest.fixture(params=[v for v in native.VARIANTS if v != "torch"])
def variant(request):
    """Every native variant this machine can run."""
    if request.param not in native.available():
        pytest.skip(native.why_unavailable(request.param))
    with native.using(request.param):
        yield request.param


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """Small weights of awkward shapes and values: K ragged against every block and past a span of
    4096 elements, one row or one column, fp8_block's last band short, a zero row, subnormal and huge
    rows, a weight whose scale underflows (float32 only)."""
    generator = torch.Generator().manual_seed(5)
    mixed = torch.randn(130, 70, generator=generator) * 0.05
    mixed[0], mixed[1, :9] = 0.0, -0.0
    mixed[2] *= 1e-39
    mixed[4] *= 3e30
    long_rows = torch.randn(3, 4100, generator=generator)
    long_rows[1, 4096:] *= 100  # the largest magnitudes in a row's second span
    weights = [torch.randn(64, 64, generator=generator), mixed, torch.randn(1, 5, generator=generator),
               torch.randn(7, 1, generator=generator), torch.zeros(3, 48), torch.full((3, 64), 1e-44),
               torch.randn(200, 300, generator=generator), long_rows]
    return [w.to(dtype) if dtype != torch.float16 else w.clamp(-6e4, 6e4).to(dtype) for w in weights]


def _laid_out(weights: list[torch.Tensor], name: str):
    """(source bytes, the op's 8 integers a weight, destination, each weight's parts in it): each source
    and part at a multiple of 64 bytes, with 64 bytes or more between them."""
    found = quant.scheme(name)
    source = torch.cat([torch.cat([w.reshape(-1).view(torch.uint8), torch.full((64 + -w.nbytes % 64,), 7,
                                                                                 dtype=torch.uint8)])
                        for w in weights])
    fields, parts, at, offset = [], [], 0, 64
    for w in weights:
        placed = {}
        for part, (dtype, shape) in found.layout(*w.shape).items():
            size = torch.Size(shape).numel() * dtype.itemsize
            placed[part] = (offset, size, dtype, shape)
            offset += -(-size // 64) * 64 + 64
        extra = placed.get("weight_global_scale")
        fields += (at, *w.shape, *placed["weight"][:2], *placed["weight_scale"][:2], extra[0] if extra else -1)
        parts.append(placed)
        at += w.nbytes + 64 + -w.nbytes % 64
    return source, fields, torch.full((offset,), FILL, dtype=torch.uint8), parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_many_weights_in_one_call_are_quantize_s_bits(variant, dtype):
    """Every scheme, each weight's parts written at their places as quantize() writes them, and not a
    byte beside them."""
    weights = _weights(dtype)
    for name in SCHEMES:
        source, fields, dest, parts = _laid_out(weights, name)
        assert quant.quantize_many(source, dtype, fields, dest, name) == -1
        untouched = torch.ones(len(dest), dtype=torch.bool)
        for w, placed in zip(weights, parts):
            want = quantize(w, name)
            for part, tensor in (("weight", want.weight), ("weight_scale", want.scale),
                                 ("weight_global_scale", want.global_scale)):
                if tensor is None:
                    continue
                offset, size, _, _ = placed[part]
                assert dest[offset:offset + size].tolist() == tensor.reshape(-1).view(torch.uint8).tolist(), \
                    (name, part, tuple(w.shape), dtype)
                untouched[offset:offset + size] = False
        assert bool((dest[untouched] == FILL).all()), name


def test_the_first_weight_not_finite_is_named(variant):
    """The op returns the index of the first weight with a NaN or an infinity, for every scheme (the
    schemes whose scale spans the weight find it in their first pass, the others as they quantize)."""
    weights = [torch.randn(16, 64), torch.randn(16, 64), torch.randn(16, 64), torch.randn(16, 64)]
    weights[2][3, 5] = float("nan")
    weights[3][0, 0] = float("inf")
    for name in SCHEMES:
        source, fields, dest, _ = _laid_out(weights, name)
        assert quant.quantize_many(source, torch.float32, fields, dest, name) == 2, name
        source, fields, dest, _ = _laid_out(weights[3:], name)
        assert quant.quantize_many(source, torch.float32, fields, dest, name) == 0, name


def test_places_outside_the_buffers_are_refused_before_anything_is_written(variant):
    """A weight or a part that does not lie within its buffer, parts of the wrong size, a place not
    aligned for what it holds (by its address), a global scale where there is none (and none where
    NVFP4 needs one), too few integers, or a stored dtype the op does not read: refused, the
    destination as it was, even where the weights before the bad one are good."""
    weights = [torch.randn(16, 64), torch.randn(8, 32)]

    def refused(name, change, match, dtype=torch.float32, shift=0):
        source, fields, dest, _ = _laid_out(weights, name)
        if shift:  # the same bytes at an address `shift` bytes further on
            source = torch.cat([torch.zeros(shift, dtype=torch.uint8), source])[shift:]
        fields = change(list(fields), len(source), len(dest))
        with pytest.raises(RuntimeError, match=match):
            quant.quantize_many(source, dtype, fields, dest, name)
        assert bool((dest == FILL).all()), match

    def at(i, value):
        def change(fields, _source, _dest):
            fields[8 + i] = value(_source, _dest)
            return fields
        return change

    def same(fields, _source, _dest):
        return fields

    outside = r"weight 1: 8x32 elements from byte -?\d+ do not lie within the \d+-byte source"
    refused("int8", at(0, lambda s, d: s - 100), outside)
    refused("int8", at(0, lambda s, d: -4), outside)
    refused("int8", at(1, lambda s, d: 1 << 62), r"weight 1: 4611686018427387904x32 elements")
    refused("int8", at(2, lambda s, d: 0), r"weight 1: 8x0 elements")
    refused("int8", at(0, lambda s, d: 4098), r"weight 1: its elements at byte 4098 of the source are not aligned")
    refused("int8", same, r"weight 0: its elements at byte 0 of the source are not aligned to their 4", shift=2)
    refused("int8", at(3, lambda s, d: d - 100), r"weight 1: its elements must be 8x32 bytes within")
    refused("int8", at(4, lambda s, d: 255), r"weight 1: its elements must be 8x32 bytes within .* got 255")
    refused("int8", at(5, lambda s, d: d), r"weight 1: its scales must be 32 bytes within the destination")
    refused("int8", at(5, lambda s, d: 66), r"weight 1: its scales at byte 66 of the destination are not aligned")
    refused("int8", at(6, lambda s, d: 4), r"weight 1: its scales must be 32 bytes .* got 4 at")
    refused("int8", at(7, lambda s, d: 64), r"weight 1: no global scale in this scheme \(-1\), got 64")
    refused("nvfp4", at(7, lambda s, d: -1), r"weight 1: its global scale must be 4 aligned bytes")
    refused("nvfp4", at(7, lambda s, d: d - 2), r"weight 1: its global scale must be 4 aligned bytes")
    refused("int8", lambda fields, s, d: fields[:-1], "8 integers a weight")
    refused("int8", same, "reads float32, bfloat16 or float16", torch.int16)


def test_a_destination_smaller_than_a_row_of_the_source_is_enough():
    """The places are all that must fit: an MXFP4 row of 4096 elements takes 2048 bytes and 128
    scales, in a destination of fewer bytes than the row has elements."""
    if not quant.many_native():
        pytest.skip("no native kernels here")
    w = torch.randn(1, 4096)
    source, dest = w.view(-1).view(torch.uint8), torch.full((2304,), FILL, dtype=torch.uint8)
    assert quant.quantize_many(source, torch.float32, [0, 1, 4096, 128, 2048, 2176, 128, -1], dest, "mxfp4") == -1
    want = quantize(w, "mxfp4")
    assert torch.equal(dest[128:2176], want.weight.view(-1))
    assert torch.equal(dest[2176:], want.scale.view(torch.uint8)[0])
