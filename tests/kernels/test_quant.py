"""Quantization formats against their scalar references, and the quantized linear layer."""

import functools

import pytest
import torch

from kernels import formats, native, quant
from kernels.dense import Dense
from kernels.fp4 import E2M1_VALUES, decode_packed, e2m1_decode, e2m1_encode, pack, unpack
from kernels.linear import LARGE_M, quantized_linear, reference_linear
from kernels.quant import SCHEMES, dequantize, layout, narrow, quantize, quantize_part
from kernels.quant_reference import quantize_reference, stored


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def test_e2m1_code_table():
    """Codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8-15 the same negated."""
    codes = torch.arange(16, dtype=torch.uint8)
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert e2m1_decode(codes).tolist() == expected
    assert e2m1_encode(e2m1_decode(codes)).tolist() == codes.tolist()


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 4.9, 7.0, 1e9, -0.74, -5.1])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 4.0, 6.0, 6.0, -0.5, -6.0]


def test_fp4_packing_puts_the_first_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack(codes).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack(pack(codes)), codes)
    assert torch.equal(decode_packed(pack(codes)), e2m1_decode(codes))


def _bits(q: quant.QuantizedWeight) -> list:
    return [None if t is None else (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).tolist())
            for t in (q.weight, q.scale, q.global_scale)]


def _ties() -> list[torch.Tensor]:
    """Weights whose every row and block holds its format's largest value, so that the scale is 1 (NVFP4:
    1 up to a rounding) and the other elements are the format's ties: int8's halves, the midpoints
    between neighbouring E4M3 values (subnormals included), and E2M1's; each a float either side too."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3) & (e4m3 >= 0)].unique()
    grids = [(torch.arange(0, 127).float() + 0.5, 127.0), ((e4m3[1:] + e4m3[:-1]) / 2, 448.0),
             (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e-30]), 6.0)]
    weights = []
    for midpoints, largest in grids:
        values = torch.cat([midpoints, torch.nextafter(midpoints, torch.zeros(())),
                            torch.nextafter(midpoints, torch.full((), 1e9))])
        values = torch.cat([values, -values])
        values = torch.cat([values, torch.zeros(-len(values) % 15)]).view(-1, 15)
        rows = torch.cat([torch.full((len(values), 1), largest), values], dim=1)  # 16: every block's first
        weights.append(rows.reshape(-1, 64) if rows.numel() % 64 == 0 else rows)
    return weights


def test_native_quantization_is_the_torch_codes_bit_for_bit(variant):
    """The native op (kernels/csrc/quantize_kernels.cpp) that quantizes every scheme on the CPU gives
    the torch code's bits: at the formats' ties, with subnormals, both zeros, tiny and huge rows side
    by side, magnitudes whose scale underflows, K ragged against every block and past a span of 4096
    elements, fp8_block's last band short, a weight the threads share in many chunks, float32,
    bfloat16 and float16 weights, a column slice (rows strided), rows of no elements; and written in
    place into parts it is given (a slab's bytes). Parts of the wrong dtype or size are refused."""
    if native.quantize is None:
        pytest.skip("the pure torch variant quantizes in torch")
    generator = torch.Generator().manual_seed(3)
    mixed = torch.randn(130, 300, generator=generator) * 0.05
    mixed[0], mixed[1, :7] = 0.0, -0.0
    mixed[2] *= 1e-39  # subnormal floats
    mixed[3, ::5] *= 1e-6
    mixed[4] *= 3e30
    long_rows = torch.randn(3, 4100, generator=generator)
    long_rows[1, 4096:] *= 100  # the largest magnitudes in a row's second span
    underflowing = torch.full((3, 64), 1e-44)  # (float32 only: amax / 127 is 0)
    cases = [*_ties(), mixed, long_rows, torch.randn(700, 2000, generator=generator), torch.randn(1, 5),
             torch.zeros(0, 5), torch.zeros(3, 0), underflowing]
    inputs = []
    for w in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            inputs.append(w.to(dtype) if dtype != torch.float16 else w.clamp(-6e4, 6e4).to(dtype))
            if w is mixed:
                inputs.append(inputs[-1][:, 64:192])  # its rows 300 elements apart
    for x in inputs:
        for scheme in SCHEMES:
            got = quantize(x, scheme)
            with native.using("torch"):
                want = quantize(x, scheme)
            assert _bits(got) == _bits(want), (scheme, tuple(x.shape), x.stride(), x.dtype)
    for scheme in SCHEMES:
        parts = layout(scheme, *mixed.shape)
        slab, out, at = torch.zeros(1 << 20, dtype=torch.uint8), {}, 64
        for part, (dtype, shape) in parts.items():  # each on 64 bytes, as a load plan lays them out
            size = torch.Size(shape).numel() * dtype.itemsize
            out[part], at = slab[at:at + size].view(dtype).view(shape), -(-(at + size) // 64) * 64
        q = quantize(mixed, scheme, out=out)
        assert q.weight.data_ptr() == out["weight"].data_ptr() and q.scale.data_ptr() == out["weight_scale"].data_ptr()
        assert _bits(q) == _bits(quantize(mixed, scheme)), scheme
    operands = (*quant.scheme("int8").native, 1.0)
    with pytest.raises(RuntimeError, match="weight must be 20 contiguous bytes"):
        native.quantize(torch.randn(4, 5), *operands, torch.empty(4, 4, dtype=torch.int8), torch.empty(4),
                        native.variant_index())
    with pytest.raises(RuntimeError, match="the parts must be Char and Float"):
        native.quantize(torch.randn(4, 5), *operands, torch.empty(4, 5, dtype=torch.uint8), torch.empty(4),
                        native.variant_index())
    with pytest.raises(RuntimeError, match="no such scheme"):
        native.quantize(torch.randn(4, 64), formats.E8M0_PER_BLOCK, 32, formats.INT8_ELEMENTS, 1.0,
                        torch.empty(4, 64, dtype=torch.int8), torch.empty(4, 2, dtype=torch.float8_e8m0fnu),
                        native.variant_index())


@pytest.fixture(params=["native", "torch"])
def path(request):
    """Runs a test on the native quantization (the best variant here) and on the torch code."""
    if request.param == "native" and native.quantize is None:
        pytest.skip("no native kernels here")
    with native.using(native.VARIANT if request.param == "native" else "torch"):
        yield request.param


def awkward_weight() -> torch.Tensor:
    """K not a multiple of any block; a zero row; tiny and huge magnitudes side by side."""
    w = torch.randn(6, 70) * 3
    w[1] = 0
    w[2, :40] *= 1e-30
    w[3, 5] = 3e30
    w[4, :] = torch.linspace(-1e-3, 1e-3, 70)
    return w


@pytest.mark.parametrize("scheme", SCHEMES)
def test_kernel_matches_scalar_reference_bit_for_bit(path, scheme):
    w = awkward_weight()
    assert stored(quantize(w, scheme)) == quantize_reference(w, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_layout_matches_what_quantize_produces(scheme):
    q = quantize(torch.randn(130, 200), scheme)
    parts = {"weight": q.weight, "weight_scale": q.scale, "weight_global_scale": q.global_scale}
    for part, (dtype, shape) in layout(scheme, 130, 200).items():
        assert (parts[part].dtype, tuple(parts[part].shape)) == (dtype, shape), part


def test_each_scheme_is_one_object_and_other_names_are_refused():
    """Every scheme name has one object, carrying its format (blocks, manifest parameters, packing);
    any other name is refused with the known ones, wherever it comes in."""
    for name in SCHEMES:
        found = quant.scheme(name)
        assert found is quant.scheme(name) and found.name == name and found.format is formats.FORMATS[name]
        stored_k = layout(name, 8, 64)["weight"][1][1] * found.format.elements_per_byte
        assert stored_k == 64, name
    for bad in ("fp4", "", None, "INT8"):
        for call in (lambda: quant.scheme(bad), lambda: layout(bad, 8, 64), lambda: quantize(torch.ones(8, 64), bad)):
            with pytest.raises(ValueError, match="known: fp8_per_tensor, fp8_per_channel"):
                call()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_slice_on_whole_blocks_is_that_slice_of_the_weight(scheme):
    """What a TP shard of a quantized weight holds: rows or columns [128, 256) of the weight, with the
    whole weight's scales; a slice off the scheme's blocks is refused."""
    q = quantize(torch.randn(256, 256), scheme)
    full = dequantize(q)
    for dim, block in enumerate(formats.FORMATS[scheme].block):
        part = narrow(q, dim, 128, 128)
        assert torch.equal(dequantize(part), full[128:] if dim == 0 else full[:, 128:]), dim
        if block > 1:
            with pytest.raises(ValueError, match="does not fall on"):
                narrow(q, dim, block // 2, block)


@pytest.mark.parametrize("scheme", ["fp8_per_tensor", "fp8_per_channel", "fp8_block", "mxfp8"])
def test_every_e4m3_value_round_trips(scheme):
    """With 448 in every row and block the scale is exactly 1, so each stored value comes back."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)]
    w = values[torch.randperm(len(values))][:252].view(2, 126).repeat(1, 2)  # K = 252: ragged blocks
    w[:, ::32] = 448.0
    assert torch.equal(dequantize(quantize(w, scheme)), w)


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
def test_every_e2m1_value_round_trips(scheme):
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    w = grid[torch.randint(len(grid), (4, 96))]
    w[:, ::16] = 6.0
    q = quantize(w, scheme)
    if scheme == "nvfp4":  # block scale 448 x global 6/2688 is 1 up to one float32 rounding
        torch.testing.assert_close(dequantize(q), w, rtol=1e-6, atol=0)
    else:
        assert torch.equal(dequantize(q), w)


def test_int8_round_trips_integers():
    w = torch.randint(-127, 128, (3, 50)).float()
    w[:, 0] = 127
    assert torch.equal(dequantize(quantize(w, "int8")), w)


@pytest.mark.parametrize("scheme, tolerance", [("fp8_per_tensor", 0.04), ("fp8_per_channel", 0.04),
                                               ("fp8_block", 0.04), ("int8", 0.01), ("mxfp8", 0.05),
                                               ("mxfp4", 0.2), ("nvfp4", 0.15)])
def test_quantization_error_is_what_the_format_allows(scheme, tolerance):
    w = torch.randn(256, 512)
    error = (dequantize(quantize(w, scheme)) - w).norm() / w.norm()
    assert error < tolerance


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zeros_and_non_finite_weights(path, scheme):
    """Zeros come back zeros, and so do magnitudes so small that a scale of them underflows (it is 1
    there: dividing by 0 had made NaN codes); a NaN or an infinity is refused."""
    assert torch.equal(dequantize(quantize(torch.zeros(4, 64), scheme)), torch.zeros(4, 64))
    assert torch.equal(dequantize(quantize(torch.full((4, 64), -1e-44), scheme)), torch.zeros(4, 64))
    for bad in (float("inf"), float("nan")):
        w = torch.randn(4, 64)
        w[2, 3] = bad
        with pytest.raises(ValueError, match="1 non-finite value"):
            quantize(w, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_float64_weight_beyond_float32s_range_is_refused(path, scheme):
    """Quantization computes in float32, where a finite float64 value past its range is an infinity
    (FP8 per tensor's scale had become one: every code 0, every value NaN once multiplied back; the
    other schemes said the weight had 0 non-finite values): refused, saying why, whole or a TP part."""
    w = torch.randn(4, 64, dtype=torch.float64)
    w[2, 3] = -1e300
    for call in (lambda: quantize(w, scheme), lambda: quantize_part(w, scheme, 0, 0, 4)):
        with pytest.raises(ValueError, match=r"beyond float32's range \(largest magnitude 1e\+300\)"):
            call()
    w[2, 3] = -1e30  # within it: quantized as its float32 value
    codes = quantize(w, scheme).weight.view(torch.uint8)
    assert torch.equal(codes, quantize(w.float(), scheme).weight.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_value_anywhere_is_found(path, dtype):
    """quantize finds a NaN or an infinity in one pass (torch.aminmax, or the native op as it
    quantizes; NVFP4 needs the largest magnitude first either way): at the first and last element,
    within and past the reductions' vector widths and a span of 4096, beside values that dwarf it,
    alone or several."""
    torch.manual_seed(0)
    w = torch.randn(67, 4200, dtype=dtype)
    cells = [(0, 0), (66, 4199), (0, 15), (1, 0), (33, 64), (66, 0), (12, 127), (5, 4100)]
    for scheme in ("int8", "fp8_block", "mxfp4", "nvfp4"):
        for bad in (float("nan"), float("inf"), -float("inf")):
            for row, column in cells:
                x = w.clone()
                x[0, 1], x[66, 129] = 3e4, -3e4  # a NaN is no smaller nor greater than them
                x[row, column] = bad
                with pytest.raises(ValueError, match="weight has 1 non-finite value"):
                    quantize(x, scheme)
        x = w.clone()
        x[3, 3], x[40, 100] = float("nan"), float("inf")
        with pytest.raises(ValueError, match="weight has 2 non-finite value"):
            quantize(x, scheme)
        assert quantize(w, scheme).weight.shape[0] == 67


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_weight_quantized_a_few_rows_at_a_time_is_the_reference_bit_for_bit(path, scheme):
    """The torch code takes a weight of more than `chunk` elements in passes of whole rows (here 14
    rows, 128 for fp8_block's blocks), into parts made once: the scalar reference's bits, and the
    whole weight's in one pass (the native op, which takes any weight whole, gives them too). The scales that span the weight (per tensor, NVFP4's global) are the whole
    weight's: its largest magnitude lies in the last pass."""
    w = torch.randn(300, 70)
    w[1] = 0
    w[2, :40] *= 1e-30
    w[150:170] *= 1e-3
    w[-1, 3] = -50.0
    in_passes = quantize(w, scheme, chunk=1000)
    assert stored(in_passes) == quantize_reference(w, scheme)
    for x in (w, w.to(torch.bfloat16)):
        whole, parts = quantize(x, scheme, chunk=1 << 40), quantize(x, scheme, chunk=1000)
        for a, b in ((whole.weight, parts.weight), (whole.scale, parts.scale),
                     (whole.global_scale, parts.global_scale)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_part_quantized_alone_is_that_part_of_the_whole_weight(path, scheme):
    """quantize_part (a TP rank's shard) gives narrow(quantize(w)) bit for bit, in one pass or a few
    rows at a time, for rows and for columns on the scheme's blocks, the whole weight's largest
    magnitude in another part (per tensor and NVFP4's global scales span the weight). Slices off the
    blocks, and non-finite values anywhere in the weight, are refused as narrow and quantize refuse
    them."""
    w = torch.randn(512, 512).to(torch.bfloat16)
    w[450, 7] = 40.0  # the largest magnitude: in the last rows, the first columns
    w[10:20] *= 1e-3
    block = formats.format_of(scheme).block
    for dim in (0, 1):
        for start, length in ((0, 128), (128, 256), (384, 128)):
            whole = narrow(quantize(w, scheme), dim, start, length)
            for chunk in (1 << 40, 2000):
                part = quantize_part(w, scheme, dim, start, length, chunk=chunk)
                assert part.shape == whole.shape
                for a, b in ((whole.weight, part.weight), (whole.scale, part.scale),
                             (whole.global_scale, part.global_scale)):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert a.dtype == b.dtype and a.shape == b.shape, (dim, start)
                        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
                            (dim, start, chunk)
        if block[dim] > 1:
            with pytest.raises(ValueError, match="does not fall on"):
                quantize_part(w, scheme, dim, block[dim] // 2, block[dim])
    with pytest.raises(ValueError, match="bad slice"):
        quantize_part(w, scheme, 0, 400, 128)
    w[0, 0] = float("nan")  # outside the part
    with pytest.raises(ValueError, match="1 non-finite value"):
        quantize_part(w, scheme, 0, 256, 128)


def _peak_rss_reset() -> int:
    """Resets this process's peak RSS (VmHWM) to its RSS, which it returns (bytes)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS here: {e}")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


@pytest.mark.parametrize("scheme", ["int8", "mxfp4", "nvfp4"])
def test_a_large_weight_is_quantized_through_small_temporaries(path, scheme):
    """An 8192x4096 bfloat16 weight (128 MiB as float32) quantized in passes: the peak memory beyond
    the weight is its quantized parts and one pass's temporaries, under three quarters of one
    float32 copy. In one pass it took 2-6 float32 copies (a float32 copy, the scaled copy, ...)."""
    w = torch.randn(8192, 4096).to(torch.bfloat16)
    before = _peak_rss_reset()
    q = quantize(w, scheme)
    assert q.weight.shape[0] == 8192
    excess = _status_bytes("VmHWM") - before
    assert excess < 0.75 * 4 * w.numel(), excess


@pytest.fixture(params=native.VARIANTS)
def variant(request):
    """Runs a test on every kernel variant this machine can run (the native ones and pure torch)."""
    if request.param not in native.available():
        pytest.skip(native.why_unavailable(request.param))
    with native.using(request.param):
        yield request.param


@functools.cache
def linear_case(scheme: str, n: int, k: int, m: int, dtype: torch.dtype):
    """A quantized weight, an activation and their reference product, made once for every variant."""
    generator = torch.Generator().manual_seed(n * 10_000 + k)
    q = quantize(torch.randn(n, k, generator=generator), scheme)
    x = torch.randn(m, k, generator=generator).to(dtype)
    return q, x, reference_linear(x, q).float()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [1, 3, 6, 11, 16, LARGE_M + 3])
@pytest.mark.parametrize("n, k", [(700, 2048), (7, 96), (5, 80), (6, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_reference(variant, scheme, m, n, k, dtype):
    """GEMV (one and several passes; on AVX2 6, 11 and 16 rows of 2048 outgrow L1 and run in passes
    of 4) and tiled paths, row counts that do not fill a step, K not a multiple of the block
    (padded), K not a multiple of 32 (a 16-element tail), K no multiple of 16 (which the native
    kernels do not take, and torch's int8 kernel read past: wrong sums, or a segfault)."""
    q, x, expected = linear_case(scheme, n, k, m, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(quantized_linear(x, q).float(), expected, rtol=tol,
                               atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("k", [16400, 16448])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 9, 16])
def test_int8_on_integer_multiply_adds_sums_long_rows_exactly(variant, m, k):
    """int8 times rows of bfloat16 x runs on integer multiply-adds (kernels/csrc/qgemv_int16.h):
    every count of rows with the avx2 and avx512 kernels, 1 to 4 rows with avx512bf16 (and, these
    rows being past L1, every count), 1 to 4 with amx (1 and 2 where K is a multiple of 64);
    x scaled by a power of two into int16. Rows of 16400 elements of 127 times x near the top of its
    range sum past what int32 holds (2^31 / (127 * 2^15) is 516 products a lane; AVX2's 8 lanes take
    2050 each, AVX-512's 16 take 1025), so the sums go to float32 every 2048 elements, and a
    16-element tail follows. On amx, 3 to 16 rows of 16448 (a multiple of 64) run on its byte tiles
    (qgemv_amx.h), whose int32 sums go into exact ones every 16384 elements. Every x here is an
    integer times 2^-8, so the expected sums are exact."""
    q = quantize(torch.ones(35, k), "int8")  # amx's tiles take 16 weight rows; the last 3 run without them
    assert bool((q.weight == 127).all())
    x = torch.full((m, k), 255 / 256).bfloat16()
    x[m // 2, ::2] = -3.5  # a row whose largest magnitude sets another power of two (the only one at m=1)
    expected = x.double() @ (q.weight.double() * q.scale.double()[:, None]).T
    got = quantized_linear(x, q)
    torch.testing.assert_close(got.double(), expected.bfloat16().double(), rtol=0, atol=0)


@pytest.mark.parametrize("m", [5, 8, 13])
def test_int8_rows_of_x_past_l1_run_in_passes_of_four(variant, m):
    """From 5 rows of x, int8 on the integer multiply-adds runs in passes of 4 rows, packed to match
    (qgemv_int16.h): on AVX-512 at every K, on AVX2 where the int16 rows pass 32 KiB (here 4160
    elements), and avx512bf16 takes such rows off its dot product: every row is the reference's, and
    each 4 rows' bits are those of the same 4 multiplied alone (amx's byte tiles take 3 rows and more
    of a K that is a multiple of 64)."""
    q, x, expected = linear_case("int8", 96, 4160, m, torch.bfloat16)
    got = quantized_linear(x, q)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    if variant in ("avx2", "avx512", "avx512bf16"):
        for first in range(0, m, 4):
            assert torch.equal(got[first:first + 4], quantized_linear(x[first:first + 4], q))


@pytest.mark.parametrize("scheme", ["none", "int8", "fp8_per_channel"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_outputs_round_to_bfloat16_as_torch_rounds_them(variant, scheme, m):
    """Whichever path a product takes (bfloat16 dot product, integer multiply-adds, float32 kernels)
    and however it rounds its outputs (in registers from 4 outputs a step, one at a time below),
    each output is its exact sum rounded as torch rounds float32 to bfloat16: ties to even, a
    tie past the largest bfloat16 to infinity, a subnormal kept. Every product and sum here is exact
    in float32."""
    if variant == "torch" and scheme != "none":
        pytest.skip("torch's path multiplies the weight dequantized to bfloat16, not these sums")
    n, k = 16, 576
    # Row 0 of x, times 2^e (e: 9 for FP8, whose kernels take the row scale times 2^8, else 0):
    codes = torch.zeros(n, k)
    codes[0::4, :2] = torch.tensor([1.0, 1.0])  # 2 (1 + 2^-8): a tie, to even (down)
    codes[1::4, :2] = torch.tensor([1.0, 3.0])  # 2 (1 + 3 2^-8): a tie, to even (up)
    codes[2::4, :3] = torch.tensor([1.0, 0.0, 3.0])  # 2 - 2^-8, times 2^(127 - e): a tie, to infinity
    codes[3::4, :2] = torch.tensor([1.0, 1.0])  # times 2^(-131 - e): a subnormal (not for bfloat16
    # weights, which the dot product would read as zero)
    e = 9 if scheme == "fp8_per_channel" else 0
    tiny = 2.0 ** (-100 if scheme == "none" else -131 - e)
    scale = torch.tensor([1.0, 1.0, 2.0 ** (126 - e), tiny]).repeat(n // 4)
    x = torch.zeros(m, k)
    x[:, :3] = torch.tensor([2.0, 2.0 ** -7, 85 * 2.0 ** -7]) * 2.0 ** e
    x = (x * 2.0 ** -torch.arange(m, dtype=torch.float32)[:, None]).bfloat16()  # row j: times 2^-j
    dense = codes * scale[:, None]
    if scheme == "none":
        got = Dense()(x, dense.bfloat16())
    else:
        narrow_codes = codes.to(torch.int8 if scheme == "int8" else torch.float8_e4m3fn)
        got = quantized_linear(x, quant.QuantizedWeight(scheme, narrow_codes, scale, None, (n, k)))
    expected = (x.double() @ dense.double().T).float()
    assert torch.equal(expected.double(), x.double() @ dense.double().T)  # exact in float32
    assert bool(got[0, 2].isinf()) and got[0, 3].item() != 0
    assert torch.equal(got.view(torch.int16), expected.bfloat16().view(torch.int16))


@pytest.mark.parametrize("k", [1040, 1088])
def test_int8_on_integer_multiply_adds_keeps_small_values_and_non_finite_rows(variant, k):
    """A row whose values span 2^16 (the small ones round to 2^-15 of its largest there), a row of
    zeros, a row of tiny values; rows with a NaN or an infinity, and one below 2^-112 (no power of two
    brings it into int16 with a normal float scale): those run the float32 kernels alone, and the
    other rows' bits are what they are beside rows of zeros. K of 1088 (a multiple of 64) takes amx's
    byte tiles at these 7 rows."""
    if variant == "avx512bf16" and k % 32 == 0:
        pytest.skip("there 7 rows run the bfloat16 dot product, which flushes subnormal products")
    q = quantize(torch.randn(300, k), "int8")
    x = torch.randn(7, k).bfloat16()
    x[0, :8] = 3000.0
    x[0, 8:] *= 0.05
    x[1] = 0
    x[2] *= 1e-30
    x[3, 5], x[4, 7] = float("nan"), float("inf")
    x[6] *= 2.0 ** -125
    got = quantized_linear(x, q)
    expected = reference_linear(x, q).float()
    for row in (0, 1, 2, 5, 6):
        torch.testing.assert_close(got[row].float(), expected[row], rtol=2e-2,
                                   atol=2e-2 * expected[row].abs().max().item() + 1e-45)
    clean = x.clone()
    clean[[3, 4, 6]] = 0
    assert torch.equal(got[[0, 1, 2, 5]], quantized_linear(clean, q)[[0, 1, 2, 5]])
    assert bool(got[3].isnan().all())
    assert bool((got[4].isinf() | got[4].isnan()).all())
    for row in range(7):  # each row alone, as a decode step of one sequence multiplies it (amx: integers)
        alone = quantized_linear(x[row:row + 1], q)[0].float()
        if row == 3:
            assert bool(alone.isnan().all())
        elif row == 4:
            assert bool((alone.isinf() | alone.isnan()).all())
        else:
            torch.testing.assert_close(alone, expected[row], rtol=2e-2,
                                       atol=2e-2 * expected[row].abs().max().item() + 1e-45)


def test_native_kernels_are_built_where_the_cpu_runs_them():
    """scripts/setup.sh builds them; a missing build here would silently test only the torch path."""
    flags = set(open("/proc/cpuinfo").read().split())
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}
    dot = avx512 | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
    expected = [variant for variant, needs in (("avx2", {"avx2", "fma", "f16c"}), ("avx512", avx512),
                                               ("avx512bf16", dot), ("amx", dot | {"amx_tile", "amx_bf16", "amx_int8"}))
                if needs <= flags]
    if not expected:
        pytest.skip("no AVX2 on this CPU")
    assert set(expected) <= set(native.available())


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_linear_on_gpu_matches_reference(scheme):
    q = quantize(torch.randn(512, 1024), scheme)
    gpu = type(q)(q.scheme, q.weight.cuda(), q.scale.cuda(), None if q.global_scale is None else q.global_scale.cuda(),
                  q.shape)
    x = torch.randn(8, 1024, dtype=torch.bfloat16)
    expected = reference_linear(x, q).float()
    got = quantized_linear(x.cuda(), gpu).float().cpu()
    # FP8 on tensor cores also quantizes the activations: a few per cent, not bit-exact.
    torch.testing.assert_close(got, expected, rtol=0.1, atol=0.1 * expected.abs().max().item())
