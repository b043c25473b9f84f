"""Choosing the native kernel variant, and what the native ops refuse."""

import importlib
import os
import shutil
import subprocess

import pytest
import torch

from kernels import linear, native
from kernels.quant import dequantize, quantize, scheme
from tests.conftest import REPO

NEEDS_AVX2 = pytest.mark.skipif("avx2" not in native.available(), reason="the avx2 kernels cannot run here")


def test_the_default_is_the_best_variant_this_machine_runs():
    assert native.resolve(None) == native.resolve("") == native.available()[0]
    assert native.available()[-1] == "torch"


def test_an_unknown_or_unavailable_variant_is_refused_with_what_runs_here():
    with pytest.raises(native.VariantUnavailableError, match="PRELOAD_KERNELS=avx1024: unknown kernel variant"):
        native.resolve("avx1024")
    with pytest.raises(native.VariantUnavailableError, match="unknown kernel variant 'avx1024'; known: amx, avx512"):
        native.use("avx1024")
    missing = [v for v in native.VARIANTS if v not in native.available()]
    if not missing:
        pytest.skip("this machine runs every variant")
    with pytest.raises(native.VariantUnavailableError, match=f"PRELOAD_KERNELS={missing[0]}: .*{missing[0]}"):
        native.resolve(missing[0])
    assert native.VARIANT == native.resolve(os.environ.get(native.ENVIRONMENT))  # a refused switch changes nothing


def test_the_environment_variable_forces_a_variant_at_import(monkeypatch):
    """The choice is made when kernels.native is imported: imported again here, in place."""
    try:
        monkeypatch.setenv(native.ENVIRONMENT, "torch")
        importlib.reload(native)
        assert native.VARIANT == "torch" and native.qgemv is None
        monkeypatch.setenv(native.ENVIRONMENT, "avx1024")
        with pytest.raises(RuntimeError, match="PRELOAD_KERNELS=avx1024"):  # the class is made anew too
            importlib.reload(native)
    finally:
        monkeypatch.undo()
        importlib.reload(native)
    assert native.VARIANT == native.resolve(os.environ.get(native.ENVIRONMENT))


@NEEDS_AVX2
def test_forcing_a_variant_changes_the_dispatch(monkeypatch):
    """torch dequantizes; avx2 runs its fused op and dequantizes nothing."""
    q = quantize(torch.randn(64, 128), "mxfp4")
    x = torch.randn(1, 128)
    calls = []
    dequantize = linear.dequantize
    monkeypatch.setattr(linear, "dequantize", lambda *a, **kw: calls.append("dequantize") or dequantize(*a, **kw))
    with native.using("torch"):
        assert native.VARIANT == "torch" and native.qgemv is None
        expected = linear.quantized_linear(x, q)
    assert calls == ["dequantize"]
    calls.clear()
    with native.using("avx2"), monkeypatch.context() as patch:  # undone before `using` restores
        assert native.qgemv == torch.ops.preload.qgemv_avx2
        op = native.qgemv
        patch.setattr(native, "qgemv", lambda *a: calls.append("qgemv_avx2") or op(*a))
        got = linear.quantized_linear(x, q)
    assert calls == ["qgemv_avx2"]
    restored = None if native.VARIANT == "torch" else getattr(torch.ops.preload, f"qgemv_{native.VARIANT}")
    assert native.qgemv == restored
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available()[:-1], reason="the native kernels are not built")
def test_an_op_for_instructions_this_cpu_lacks_refuses_to_run():
    missing = [v for v in ("avx512", "avx2") if v not in native.available()]
    if not missing:
        pytest.skip("this CPU runs every native variant")
    q = quantize(torch.randn(16, 32), "fp8_per_tensor")
    op = getattr(torch.ops.preload, f"qgemv_{missing[0]}")
    with pytest.raises(RuntimeError, match="kernels need instructions this CPU lacks"):
        op(torch.randn(1, 32), q.weight, q.scale, None, 0, 0, 0)


@NEEDS_AVX2
@pytest.mark.parametrize("args, message", [
    ((torch.randn(1, 32), torch.zeros(16, 32, dtype=torch.uint8), torch.ones(15), None, 1, 0, 0), "per-row scale"),
    ((torch.randn(1, 32), torch.zeros(16, 32, dtype=torch.uint8), torch.ones(()), None, 0, 0, 7), "element format"),
    ((torch.randn(1, 48), torch.zeros(16, 32, dtype=torch.uint8), torch.ones(()), None, 0, 0, 0), "x has K=48"),
    ((torch.randn(1, 32), torch.zeros(16, 24, dtype=torch.uint8), torch.ones(()), None, 0, 0, 0), "multiples of 16"),
    ((torch.randn(1, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.uint8), None, 4, 16, 1),
     "NVFP4 needs its float32 global scale"),
    ((torch.randn(1, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4), None, 1, 0, 1), "no scheme has"),
])
def test_native_ops_refuse_inconsistent_inputs(args, message):
    """A bad shape is an error, never a stray read."""
    for op in (torch.ops.preload.qgemv_avx2, torch.ops.preload.qgemm_avx2):
        with pytest.raises(RuntimeError, match=message):
            op(*args)


@pytest.mark.parametrize("variant", [v for v in native.available() if v != "torch"])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("k", [336, 320])
def test_bfloat16_weights_on_the_fused_kernel_match_the_float32_product(variant, rows, k):
    """The bfloat16 element format: any N (tails of the 4- and 2-row steps), K a multiple of 16 but
    not of 32 (the 16-element tail; the AVX-512 kernels on avx512bf16) and of 32 (the dot product
    there), strided x, more rows than one pass takes; float32 and bfloat16 x."""
    torch.manual_seed(rows)
    w = torch.randn(203, k).bfloat16()
    x = torch.randn(rows, 2 * k)[:, ::2]
    expected = x @ w.float().T
    op = getattr(torch.ops.preload, f"qgemv_{variant}")
    torch.testing.assert_close(op(x, w, torch.ones(()), None, 0, 0, 3), expected, rtol=1e-5, atol=1e-4)
    got = op(x.bfloat16(), w, torch.ones(()), None, 0, 0, 3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.bfloat16().float() @ w.float().T).bfloat16().float(),
                               rtol=1e-2, atol=1e-2)
    dequantized = getattr(torch.ops.preload, f"qgemm_{variant}")(x, w, torch.ones(()), None, 0, 0, 3)
    torch.testing.assert_close(dequantized, expected, rtol=1e-5, atol=1e-4)


@NEEDS_AVX2
def test_bfloat16_element_format_refuses_other_weights_and_scales():
    for op in (torch.ops.preload.qgemv_avx2, torch.ops.preload.qgemm_avx2):
        with pytest.raises(RuntimeError, match="contiguous bfloat16"):
            op(torch.randn(1, 32), torch.zeros(4, 32, dtype=torch.uint8), torch.ones(()), None, 0, 0, 3)
        with pytest.raises(RuntimeError, match="no scheme has"):
            op(torch.randn(1, 32), torch.zeros(4, 32, dtype=torch.bfloat16), torch.ones(4), None, 1, 0, 3)


def test_a_stale_or_broken_library_leaves_the_torch_path_with_how_to_rebuild(tmp_path, monkeypatch, caplog):
    """A library that cannot be loaded (another torch's build, a truncated file) or lacks ops (built
    from older sources) turns the native kernels off with a warning; nothing fails to import."""
    broken = tmp_path / "libpreload_kernels.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setattr(native, "_LIBRARY", str(broken))
    monkeypatch.setattr(native, "_broken", "")
    with caplog.at_level("WARNING", logger="kernels.native"):
        assert native._load() == ()
    assert "rebuild it: python scripts/build_kernels.py --force" in caplog.text
    monkeypatch.setattr(native, "_RUNNABLE", ())
    assert native.available() == ("torch",)
    assert "cannot run: " in native.why_unavailable("avx2") and str(broken) in native.why_unavailable("avx2")


@NEEDS_AVX2
def test_native_ops_take_zero_rows():
    q = quantize(torch.randn(16, 32), "fp8_per_tensor")
    for op in (torch.ops.preload.qgemv_avx2, torch.ops.preload.qgemm_avx2):
        assert op(torch.randn(0, 32), q.weight, q.scale, None, 0, 0, 0).shape == (0, 16)


@NEEDS_AVX2
def test_a_nan_stays_a_nan_when_rounded_to_bfloat16():
    """A NaN whose high mantissa bits are all ones must not round over into -0 (a hostile scale)."""
    q = quantize(torch.randn(16, 32), "fp8_per_tensor")
    nan = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    out = torch.ops.preload.qgemv_avx2(torch.randn(1, 32).bfloat16(), q.weight, nan.reshape(()), None, 0, 0, 0)
    assert out.isnan().all()


@pytest.mark.skipif("amx" not in native.available(), reason="this CPU (or its kernel) has no AMX tiles")
@pytest.mark.parametrize("k", [320, 352])
@pytest.mark.parametrize("rows", [2, 3, 8, 16, 17])
def test_batched_products_on_the_matrix_units_match_the_reference(rows, k):
    """The AMX GEMV (bfloat16 activations, 3 to 16 rows, e4m3 and e2m1 from 2, K a multiple of 32) for plain
    bfloat16, FP8 (per channel, and its 128x128 blocks: K 320 ends in a part block; K 352 ends in a
    chunk of 32 after e4m3's pairs of chunks), MX and NVFP4 weights, and int8 from 3 rows on where K
    is a multiple of 64 (on the byte tiles; otherwise the integer multiply-adds take up to 4 rows and
    the bfloat16 tiles more; 2 rows run on the integers): N off the 16-row tiles (the tail runs the
    AVX-512 kernels), x strided, and the same rows one at a time (AVX-512) agree up to the output's
    bfloat16 rounding. Float32 activations and more rows take the AVX-512 kernels, as exactly as
    there; fewer rows run on the bfloat16 dot product."""
    torch.manual_seed(rows)
    w = torch.randn(203, k)
    x = torch.randn(rows, 2 * k)[:, ::2].bfloat16()
    cases = [(w.bfloat16(), (torch.ones(()), None, 0, 0, 3), x.float() @ w.bfloat16().float().T)]
    for name in ("int8", "fp8_per_channel", "fp8_block", "mxfp8", "mxfp4", "nvfp4"):
        q = quantize(w, name)
        weight, *operands = scheme(name).native_operands(q)
        cases.append((weight, operands, x.float() @ dequantize(q, torch.float32).T))
    for weight, operands, expected in cases:
        got = torch.ops.preload.qgemv_amx(x, weight, *operands)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)
        one_by_one = torch.cat([torch.ops.preload.qgemv_avx512(row[None], weight, *operands) for row in x])
        torch.testing.assert_close(got.float(), one_by_one.float(), rtol=1e-2, atol=1e-2)
        wide = torch.ops.preload.qgemv_amx(x.float(), weight, *operands)
        torch.testing.assert_close(wide, torch.ops.preload.qgemv_avx512(x.float(), weight, *operands), rtol=0, atol=0)


DOT_VARIANTS = [v for v in ("avx512bf16", "amx") if v in native.available()]


@pytest.mark.skipif(not DOT_VARIANTS, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("variant", DOT_VARIANTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("k", [320, 336])
def test_the_block_scaled_gemvs_on_the_bfloat16_dot_product_match_the_reference(variant, rows, k):
    """MXFP4 and NVFP4 with bfloat16 activations and K a multiple of 64, MXFP8 (its scales folded into
    the weight from 3 rows of x on) with K a multiple of 32, and FP8 with 128 x 128 block scales and K a multiple of 32
    (320: a last block of 64), run on AVX512-BF16's dot product (qgemv_bf16dot.h; amx for the rows its
    tiles do not take, but MXFP4's and NVFP4's one and two rows: its integer multiply-adds), in passes
    of up to 8 rows, two weight rows at a time from 4 rows of x on: N off the 4- and 2-row steps and
    the 128-row blocks, x strided; and they agree with the AVX-512 kernels row by row up to the
    output's bfloat16 rounding. K = 336 (a multiple of 16 but
    not of 32) and float32 x run the AVX-512 kernels, exactly as there."""
    torch.manual_seed(rows * k)
    w = torch.randn(203, k)
    x = torch.randn(rows, 2 * k)[:, ::2].bfloat16()
    op = getattr(torch.ops.preload, f"qgemv_{variant}")
    for name in ("mxfp4", "nvfp4", "mxfp8", "fp8_block"):
        q = quantize(w, name)
        weight, *operands = scheme(name).native_operands(q)
        expected = x.float() @ dequantize(q, torch.float32)[:, :k].T
        got = op(x, weight, *operands)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)
        one_by_one = torch.cat([torch.ops.preload.qgemv_avx512(row[None], weight, *operands) for row in x])
        torch.testing.assert_close(got.float(), one_by_one.float(), rtol=1e-2, atol=1e-2)
        wide = op(x.float(), weight, *operands)
        torch.testing.assert_close(wide, torch.ops.preload.qgemv_avx512(x.float(), weight, *operands), rtol=0, atol=0)


@pytest.mark.skipif("avx512bf16" not in native.available(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_mx_scales_fold_into_the_weight_only_where_that_is_exact(name):
    """On the dot product (avx512bf16: amx takes 2 rows of x and more on its tiles) MXFP8 adds each
    block's power of two to its bfloat16 weights' exponents from 3 rows of x on: rows whose codes
    would leave the normal bfloat16 range (below 18, 2^-109), and the rows paired with them from 4
    rows of x, run the AVX-512 kernels instead, bit for bit as there; the rest, down to the smallest
    code that folds and up to the largest (254), match the float64 product of the dequantized
    weight. A row of e4m3's smallest subnormal at code 17 would read as zeros if it were folded. At
    one and two rows of x, and for MXFP4, the scales multiply the sums, and every row matches."""
    torch.manual_seed(11)
    n, k = 17, 512
    q = quantize(torch.randn(n, k), name)
    codes = q.scale.view(torch.uint8)
    lowest = 18 if name == "mxfp8" else 0
    per_row = [0, 1, 17, lowest, lowest + 1, 100, 127, 140, 17, 200, 230, 3, 18, 127, 64, 0, 19]
    codes.copy_(torch.tensor(per_row, dtype=torch.uint8)[:, None].expand_as(codes))
    codes[5, 3] = 17  # one block below the range: the whole row runs the AVX-512 kernels
    if name == "mxfp8":
        elements = q.weight.view(torch.uint8)
        elements[2] = 0x01  # 2^-9 at 2^-110: folded, a bfloat16 subnormal, which the dot product reads as 0
        codes[10] = 254  # the largest code that folds: 2^-6 at 2^127, normal bfloat16
        elements[10] = torch.where(torch.arange(k) % 3 == 0, 0x88, 0x08).to(torch.uint8)
    weight, *operands = scheme(name).native_operands(q)
    reference = dequantize(q, torch.float64)
    folds = (codes >= lowest).all(dim=1)
    assert 0 < folds.sum() < n or name == "mxfp4"
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, k).bfloat16()
        got = torch.ops.preload.qgemv_avx512bf16(x, weight, *operands)
        avx512 = torch.ops.preload.qgemv_avx512(x, weight, *operands)
        expected = x.double() @ reference[:, :k].T
        for r in range(n):
            scale = expected[:, r].abs().max().item()
            assert 0 < scale < 2.0 ** 127
            torch.testing.assert_close(got[:, r].double(), expected[:, r], rtol=1e-2, atol=1e-2 * scale)
            if not folds[r] and rows > 2:
                torch.testing.assert_close(got[:, r], avx512[:, r], rtol=0, atol=0)


@pytest.mark.skipif("amx" not in native.available(), reason="this CPU (or its kernel) has no AMX tiles")
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_mx_scales_fold_into_the_tiles_only_where_that_is_exact(name):
    """amx's tiles add each MX block's power of two to the exponents of the decoded bfloat16 weights,
    16 weight rows at a time: a group of 16 with a code outside the range where every value stays
    within [2^-100, 2^128) (MXFP8 44-254, MXFP4 28-252) runs the AVX-512 kernels instead, bit for bit
    as there (as do the rows after the last 16); the rest, codes at the range's ends included, match
    the float64 product of the dequantized weight. (MXFP4 at code 2, its smallest value 2^-126, lost
    3% of an output to the tiles' flushing of float32 subnormal partial sums.)"""
    torch.manual_seed(12)
    n, k = 69, 512
    q = quantize(torch.randn(n, k), name)
    codes, elements = q.scale.view(torch.uint8), q.weight.view(torch.uint8)
    low, high = (44, 254) if name == "mxfp8" else (28, 252)
    codes.copy_(torch.randint(100, 140, codes.shape, dtype=torch.uint8))
    codes[0] = low
    codes[1, 3] = high  # one block at the largest code, with one small element, that the sum stays finite
    if name == "mxfp8":
        elements[1, 96:128] = 0
        elements[1, 100] = 0x08  # 2^-6 x 2^127
    else:
        elements[1, 48:64] = 0
        elements[1, 48] = 0x01  # 0.5 x 2^125
    codes[20, 5] = low - 1  # rows 16-31 run the AVX-512 kernels
    codes[36, 7] = high + 1  # rows 32-47 too (MXFP8's 255 is NaN)
    if name == "mxfp4":  # one element in that block, 0.5 x 2^126: finite sums
        elements[36, 112:128] = 0
        elements[36, 112] = 0x01
    codes[56] = 1  # rows 48-63 too: every value of row 56 folded would be subnormal, read as 0
    weight, *operands = scheme(name).native_operands(q)
    reference = dequantize(q, torch.float64)
    for rows in (2, 3, 8, 16) if name == "mxfp8" else (3, 8, 16):  # e4m3 takes the tiles from 2 rows
        x = (torch.randn(rows, k).sign() * (1 + torch.rand(rows, k))).bfloat16()  # products stay normal
        got = torch.ops.preload.qgemv_amx(x, weight, *operands)
        avx512 = torch.ops.preload.qgemv_avx512(x, weight, *operands)
        expected = x.double() @ reference.T
        for r in range(n):
            if 16 <= r:
                torch.testing.assert_close(got[:, r], avx512[:, r], rtol=0, atol=0, equal_nan=True)
                continue
            scale = expected[:, r].abs().max().item()
            assert 0 < scale < 2.0**127
            torch.testing.assert_close(got[:, r].double(), expected[:, r], rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.skipif("amx" not in native.available(), reason="this CPU (or its kernel) has no AMX tiles")
def test_nvfp4_tiles_read_every_e4m3_scale_code():
    """amx's tiles look NVFP4's 16 values of a block up in a table of every e2m1 value times every
    e4m3 scale: each code but NaN as a block scale (the subnormals, 448, and negative ones, which no
    quantizer writes; each row's 4 blocks different codes), against the float64 product of the
    dequantized weight."""
    torch.manual_seed(13)
    q = quantize(torch.randn(256, 64), "nvfp4")
    codes = (torch.arange(256)[:, None] + 67 * torch.arange(4)) % 256  # every code in each block column
    codes[codes & 0x7F == 0x7F] = 0x7E
    q.scale.view(torch.uint8).copy_(codes.to(torch.uint8))
    weight, *operands = scheme("nvfp4").native_operands(q)
    reference = dequantize(q, torch.float64)
    for rows in (3, 8, 16):
        x = torch.randn(rows, 64).bfloat16()
        expected = (x.double() @ reference.T).bfloat16().double()
        got = torch.ops.preload.qgemv_amx(x, weight, *operands).double()
        bound = 1e-2 * (expected.abs() + expected.abs().amax(dim=0))  # relative, and to each weight row's largest
        assert ((got - expected).abs() <= bound).all(), (got - expected).abs().amax(dim=0)


@pytest.mark.skipif("amx" not in native.available(), reason="this CPU (or its kernel) has no AMX tiles")
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("k", [64, 192, 512, 576])
def test_e2m1_at_one_and_two_rows_on_the_integers_matches_the_dequantized_product(name, k):
    """amx multiplies MXFP4 and NVFP4 by one or two rows of bfloat16 x on integer multiply-adds
    (qgemv_e2m1_int16.h: the codes as int16 twice their value, x scaled into int16 by a power of
    two): every code pair in each row's bytes, K in steps of 128 with and without a last half step
    of 64, block scales over their range (MX codes 0 to 240, as large as leaves the outputs finite: x's
    2^s must not multiply the sums that a block scale does; NVFP4 every e4m3 code but NaN), x
    spread over 2^40 (its small elements rounded by at most 2^-15 of its largest), against the
    float64 product of the dequantized weight; a row of x with a NaN, an infinity, or too small to
    scale runs the AVX-512 kernels, bit for bit as there."""
    torch.manual_seed(k)
    n = 256
    q = quantize(torch.randn(n, k), name)
    q.weight.view(torch.uint8).copy_(((torch.arange(n)[:, None] + torch.arange(k // 2)) % 256).to(torch.uint8))
    codes = q.scale.view(torch.uint8)
    if name == "mxfp4":
        codes.copy_((torch.arange(n)[:, None] + 37 * torch.arange(codes.shape[1])) % 241)
    else:
        every = (torch.arange(n)[:, None] + 67 * torch.arange(codes.shape[1])) % 256
        codes.copy_(torch.where(every & 0x7F == 0x7F, 0x7E, every))
    weight, *operands = scheme(name).native_operands(q)
    reference = dequantize(q, torch.float64)[:, :k]
    op = torch.ops.preload.qgemv_amx
    for rows, spread in ((1, 0), (1, 40), (2, 0), (2, 40)):
        x = (torch.randn(rows, k) * 2.0 ** -torch.randint(0, spread + 1, (rows, k))).bfloat16()
        expected = (x.double() @ reference.T).bfloat16().double()
        got = op(x, weight, *operands).double()
        assert got.isfinite().all()
        # bfloat16's rounding of the output, float32's of the sums, and int16's of x's small elements
        rounding = 2.0**-15 * x.abs().amax(dim=1, keepdim=True).double() * reference.abs().sum(dim=1)
        bound = 1e-2 * expected.abs() + 1e-5 * (x.abs().double() @ reference.abs().T) + rounding
        assert ((got - expected).abs() <= bound).all(), ((got - expected).abs() / bound).max()
    good, nan, infinite, tiny = torch.randn(4, 1, k).bfloat16()
    nan[0, k // 3], infinite[0, k // 3] = float("nan"), float("inf")
    for x in (nan, infinite, tiny * 2.0**-120):
        torch.testing.assert_close(op(x, weight, *operands), torch.ops.preload.qgemv_avx512(x, weight, *operands),
                                   rtol=0, atol=0, equal_nan=True)
        both = op(torch.cat([good, x]), weight, *operands)  # the other row as alone
        torch.testing.assert_close(both, torch.cat([op(good, weight, *operands), op(x, weight, *operands)]),
                                   rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("variant", [v for v in native.available() if v != "torch"])
@pytest.mark.parametrize("name", ["fp8_per_tensor", "fp8_per_channel", "fp8_block", "mxfp8"])
def test_fp8_gemv_reads_every_e4m3_code_exactly(variant, name):
    """Every e4m3 code but NaN (both zeros, the subnormals, the largest magnitude) as a weight
    element, then the zeros and subnormals alone, at 1, 2, 4 and 8 rows of bfloat16 x: each variant's
    GEMV (on the dot product up to 4 rows, both bytes of each bfloat16 word looked up, 64 elements at
    a time, and a last 32 alone: on avx512bf16 in a table of words, as it does from 5 rows on, on amx
    by moving a normal code's bits into place; amx from 2 rows on on its tiles) matches the float32
    product of the dequantized weight up to the output's bfloat16 rounding; subnormals are not
    flushed. K = 608: 9 pairs of chunks and one alone, and MXFP8's scales at one and two rows of x
    read 16 blocks at a time, the second 16 within the pairs."""
    torch.manual_seed(7)
    n, k = 96, 608
    q = quantize(torch.randn(n, k), name)
    op = getattr(torch.ops.preload, f"qgemv_{variant}")
    every = (torch.arange(n * k) % 256).view(n, k)
    every[(every & 0x7F) == 0x7F] = 0x01  # NaN -> the smallest subnormal
    subnormals = torch.where(every & 0x78 == 0, every, 0)  # exponent 0
    for codes in (every, subnormals):
        q.weight.view(torch.uint8).copy_(codes.to(torch.uint8))
        weight, *operands = scheme(name).native_operands(q)
        reference = dequantize(q, torch.float32)
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, k).bfloat16()
            expected = x.float() @ reference.T
            assert expected.abs().max() > 0
            torch.testing.assert_close(op(x, weight, *operands).float(), expected.bfloat16().float(), rtol=1e-2,
                                       atol=1e-2 * expected.abs().max().item())


SUM = """
template <typename T> struct Sum {
    T s{};
    __attribute__((noinline)) void add(const T* x, long n) { for (long i = 0; i < n; ++i) s += x[i]; }
};
"""
LEAKY = "#include <vector>\n" + SUM + """
float total(const float* x, long n) {
    Sum<float> a; a.add(x, n); std::vector<float> v(x, x + n); v.push_back(a.s); return v.back();
}
"""
CONTAINED = "namespace {" + SUM + """}
float total(const float* x, long n) { Sum<float> a; a.add(x, n); return a.s; }
"""


@pytest.mark.skipif(not (shutil.which("g++") and shutil.which("nm")), reason="needs g++ and nm")
def test_the_build_refuses_a_weak_function_in_a_unit_for_an_instruction_set(tmp_path, monkeypatch, capsys):
    """A template the compiler emits out of line in an AVX-512 unit is a weak copy the linker may
    keep for the whole library, AVX2 code included: build_kernels names it (and fails the build: its
    own units are checked so at every build, set-up's included); the same code in an anonymous
    namespace, as the ISA units keep theirs, passes."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    build_kernels = importlib.import_module("build_kernels")
    objects = {}
    for name, source in (("leaky", LEAKY), ("contained", CONTAINED)):
        (tmp_path / f"{name}.cpp").write_text(source)
        subprocess.run(["g++", "-O2", "-mavx512f", "-c", str(tmp_path / f"{name}.cpp"), "-o",
                        str(tmp_path / f"{name}.o")], check=True)
        objects[name] = tmp_path / f"{name}.o"
    leaks = build_kernels.isa_leaks({"leaky": objects["leaky"]})
    assert any("Sum<float>::add(float const*, long)" in leak for leak in leaks), leaks
    assert any("std::vector<float" in leak for leak in leaks), leaks
    assert all(leak.startswith("leaky.o defines ") and "anonymous namespace" in leak for leak in leaks)
    assert build_kernels.isa_leaks({"contained": objects["contained"]}) == []
    assert not build_kernels.units_contained(objects)  # what the build runs: it fails, saying why
    assert build_kernels.units_contained({"contained": objects["contained"]})
    monkeypatch.setenv("PATH", str(tmp_path))  # no nm: the build fails and says what to install
    assert not build_kernels.units_contained({"contained": objects["contained"]})
    err = capsys.readouterr().err
    assert "leaky.o defines Sum<float>::add" in err and "nm is missing; install GNU binutils" in err
