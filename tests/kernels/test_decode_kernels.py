"""The decode path's kernels against their plain references: rope tables and rotation, attention
over a float32 cache view, the decode and prefill attentions over the KV cache, the widened
reduced-precision product, the norm on reduced precision."""

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import (PREFILL_VARIANTS, attention_reference, cached_attention, decode_attention,
                               has_decode_attention, prefill_attention)
from kernels import dense as dense_module
from kernels import native
from kernels.dense import Dense, native_rows, widened_linear
from kernels.norm import rms_norm
from kernels.rope import apply_rope, cos_sin, inv_freq, rope_table, rotate


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_and_rotate_equal_cos_sin_and_apply_rope_bit_for_bit(dtype):
    freqs = inv_freq(32, 10000.0)
    positions = torch.tensor([[0, 1, 2, 3], [7, 50, 100, 300]])
    cos, sin = cos_sin(freqs, positions, dtype)
    table = rope_table(freqs, 301, dtype)[positions]
    assert torch.equal(table[..., 0, :], cos) and torch.equal(table[..., 1, 16:], sin[..., 16:])
    assert torch.equal(table[..., 1, :16], -sin[..., :16])
    x = torch.randn(2, 4, 3, 32).to(dtype)  # [B, T, heads, D], the projections' layout
    expected = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(rotate(x, table[:, :, None, 0], table[:, :, None, 1]), expected)
    out = x.clone()
    rotate(out, table[:, :, None, 0], table[:, :, None, 1], out=out)  # in place, as the model runs it
    assert torch.equal(out, expected)


@pytest.mark.parametrize("batch, t, s", [(1, 1, 9), (3, 1, 12), (2, 4, 10)])
def test_cached_attention_over_a_strided_cache_view(batch, t, s):
    """Keys and values as views of the engine's cache (not contiguous), GQA, rows ending at
    different positions, against the plain reference."""
    cache = torch.randn(batch + 1, 2, 2, s + 5, 16)  # [slots, k/v, kv heads, max_len, D]
    live = cache[1:, :, :, :s].transpose(0, 1)  # [2, B, KV, S, D]
    q = torch.randn(batch, t, 8, 16)
    ends = torch.tensor([s - 1 - i for i in range(batch)])
    positions = ends[:, None] - torch.arange(t - 1, -1, -1)[None, :]
    hidden = (torch.arange(s) > positions[:, :, None]).view(batch, 1, 1, t, s)
    out = cached_attention(q, live[0], live[1], hidden)
    expected = attention_reference(q.transpose(1, 2), live[0], live[1], positions).transpose(1, 2)
    torch.testing.assert_close(out, expected.reshape(batch, t, -1), rtol=1e-5, atol=1e-5)
    if t == 1 and batch == 1:  # one query at the last position sees every key: no mask needed
        torch.testing.assert_close(cached_attention(q, live[0], live[1], None), out, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [2, 8, 70])
def test_widened_linear_matches_float_reference(rows):
    w = torch.randn(1000, 96).bfloat16()
    x = torch.randn(rows, 96).bfloat16()
    expected = (x.float() @ w.float().T).bfloat16()
    # A scratch smaller than the weight: several tiles, each multiplied into its columns.
    out = widened_linear(x, w, torch.empty(300 * 96))
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert out.dtype == torch.bfloat16


def test_dense_keeps_torch_s_kernel_without_native_kernels_and_when_asked():
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    with native.using("torch"):
        assert torch.equal(Dense()(x[:1], w), F.linear(x[:1], w))
    dense = Dense()
    assert torch.equal(dense(x, w, exact=True), F.linear(x, w))
    torch.testing.assert_close(dense(x, w), F.linear(x, w), rtol=1e-2, atol=1e-2)
    assert torch.equal(dense(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32: torch's GEMM


# Rows of x the native bfloat16 GEMV takes, per variant, where torch's bfloat16 GEMM is slow, where
# oneDNN runs it without AMX tiles, and where it runs on them (kernels/dense.py, as measured).
NATIVE_ROWS = {"slow": {"avx2": 8, "avx512": 8, "avx512bf16": 8, "amx": 16, "torch": 0},
               "dot": {"avx2": 8, "avx512": 8, "avx512bf16": 8, "amx": 16, "torch": 0},
               "tiles": {"avx2": 1, "avx512": 1, "avx512bf16": 8, "amx": 16, "torch": 0}}


@pytest.mark.parametrize("gemm", ["slow", "dot", "tiles"])
@pytest.mark.parametrize("variant", native.available())
def test_dense_runs_a_few_bfloat16_rows_on_the_native_kernel(variant, gemm, monkeypatch):
    """One row (a decode step: the kernel prefetches what torch's GEMV waits for), and up to as many
    rows as beat torch's bfloat16 GEMM of this kind (or the widened tiles where it is slow) take the
    fused kernel where it is chosen; more rows do not. Every kind of GEMM, whatever this CPU has."""
    monkeypatch.setattr(dense_module, "reduced_gemm_is_slow", lambda device: gemm == "slow")
    monkeypatch.setattr(dense_module, "torch_gemm_on_tiles", lambda: gemm == "tiles")
    w, x = torch.randn(300, 96).bfloat16(), torch.randn(20, 96).bfloat16()
    with native.using(variant), monkeypatch.context() as patch:  # undone before `using` restores
        dense, calls = Dense(), []
        assert dense.widen == (gemm == "slow")
        op = native.qgemv
        if op is not None:
            patch.setattr(native, "qgemv", lambda *a: calls.append(a[0].shape[0]) or op(*a))
        for rows in range(1, 21):
            torch.testing.assert_close(dense(x[:rows], w).float(), (x[:rows].float() @ w.float().T),
                                       rtol=1e-2, atol=3e-2)
        rows = native_rows()
    assert rows == NATIVE_ROWS[gemm][variant]
    assert calls == ([1] if rows else []) + list(range(2, rows + 1))


@pytest.mark.parametrize("variant", native.available())
def test_rms_norm_on_bfloat16_equals_the_float32_path(variant):
    """torch's path bit for bit; the native norm sums the squares in another order, so a few
    elements in a million differ, by one bfloat16 step at most. Every row as if alone."""
    x = (torch.randn(4096, 576) * torch.rand(4096, 1) * 30).bfloat16()
    w = torch.randn(576).bfloat16()
    expected = w * F.rms_norm(x.float(), (576,), eps=1e-5).bfloat16()
    with native.using(variant):
        got = rms_norm(x, w, 1e-5)
        assert torch.equal(rms_norm(x[7:8], w, 1e-5), got[7:8])
        assert torch.equal(rms_norm(x.view(64, 64, 576)[1:3], w, 1e-5).view(-1, 576), got[64:192])
    if variant == "torch":
        assert torch.equal(got, expected)
    else:
        differ = got != expected
        assert differ.sum() <= x.numel() // 100_000
        step = expected.float().abs() * 2 ** -7  # a bfloat16 step is at most 2^-7 of the value
        assert (got.float() - expected.float()).abs()[differ].le(step[differ] * 1.01).all()


@pytest.mark.parametrize("variant", [v for v in native.available() if v != "torch"])
def test_native_rms_norm_on_float32_and_what_it_refuses(variant):
    x, w = torch.randn(5, 96), torch.randn(96)
    with native.using(variant):
        torch.testing.assert_close(rms_norm(x, w, 1e-6), w * F.rms_norm(x, (96,), eps=1e-6), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rms_norm(x.bfloat16(), w, 1e-6), w * F.rms_norm(x.bfloat16(), (96,), eps=1e-6))
    with pytest.raises(RuntimeError, match="weight must be contiguous \\[K\\]"):
        torch.ops.preload.rms_norm(x, torch.randn(95), 1e-6)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        torch.ops.preload.rms_norm(x, w.bfloat16(), 1e-6)


@pytest.mark.skipif(not has_decode_attention(), reason="the native kernels are not built or not chosen")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_each_row_s_slot_and_length_in_place(dtype):
    """Rows at scattered slots with their own lengths, GQA, against the plain reference over the
    same keys; what lies past a row's length (here: huge values) is never read."""
    cache = torch.randn(5, 2, 2, 40, 16).to(dtype)  # [slots, k/v, kv heads, max_len, D]
    cache[..., 30:, :] = 1e4
    slots, lengths = torch.tensor([3, 0, 4]), torch.tensor([30, 1, 17])
    q = torch.randn(3, 6, 16).to(dtype)
    out = decode_attention(q, cache, slots, lengths)
    assert out.shape == (3, 96) and out.dtype == dtype
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        keys, values = cache[slot, :, None, :, :length]  # [1, KV, S, D] each
        expected = attention_reference(q[row, None, :, None], keys, values, torch.tensor([[length - 1]]))
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[row], expected.reshape(-1), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("variant", [v for v in native.available() if v != "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, kv_heads, heads", [(64, 3, 9), (128, 2, 16), (96, 1, 3), (32, 2, 4), (80, 1, 5),
                                                       (72, 2, 4), (24, 1, 7)])
def test_decode_attention_on_every_variant_head_size_and_group(variant, dtype, head_dim, kv_heads, heads):
    """Each variant's kernel scores keys a register's width of positions at a time and weighs values
    for several heads at once: lengths on and off those blocks (1 to 2 blocks and one more), head
    sizes with a partial block of output registers (80) and elements past the last register (72,
    24), groups of 1 to 8 heads, against the plain reference. Past 256 positions a sequence's kv
    head is split into parts of 256 whose results merge (257: a part of one position; 600: three).
    On AVX512-BF16 a bfloat16 model's scores run on the dot product for head sizes 32, 64, 96 and 128."""
    cache = torch.randn(6, 2, kv_heads, 600, head_dim).to(dtype)
    slots, lengths = torch.tensor([1, 3, 0, 2, 5, 4]), torch.tensor([1, 16, 17, 33, 257, 600])
    q = torch.randn(6, heads, head_dim).to(dtype)
    with native.using(variant):
        out = decode_attention(q, cache, slots, lengths)
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        keys, values = cache[slot, :, None, :, :length]
        expected = attention_reference(q[row, None, :, None], keys, values, torch.tensor([[length - 1]]))
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[row], expected.reshape(-1), rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not has_decode_attention(), reason="the native kernels are not built or not chosen")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_split_rows_do_not_depend_on_their_company_or_the_threads(dtype):
    """A long sequence's parts go to whichever threads are free, but merge in a fixed order: each row
    is bit for bit the same alone, beside other rows, and on one thread or two."""
    cache = torch.randn(4, 2, 3, 600, 64).to(dtype)
    slots, lengths = torch.tensor([2, 0, 3]), torch.tensor([600, 7, 257])
    q = torch.randn(3, 9, 64).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = decode_attention(q, cache, slots, lengths)
        torch.set_num_threads(1)
        one_thread = decode_attention(q, cache, slots, lengths)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for row in range(3):
        alone = decode_attention(q[row:row + 1], cache, slots[row:row + 1], lengths[row:row + 1])
        assert torch.equal(alone[0], together[row])


@pytest.mark.skipif(not has_decode_attention(), reason="the native kernels are not built or not chosen")
@pytest.mark.parametrize("slots, lengths, message", [
    ([5], [3], "slot 5 or length 3 is outside"), ([0], [41], "length 41 is outside"), ([0], [0], "length 0"),
    ([-1], [3], "slot -1"),
])
def test_decode_attention_refuses_rows_outside_the_cache(slots, lengths, message):
    cache, q = torch.randn(5, 2, 2, 40, 16), torch.randn(1, 6, 16)
    with pytest.raises(RuntimeError, match=message):
        decode_attention(q, cache, torch.tensor(slots), torch.tensor(lengths))
    with pytest.raises(RuntimeError, match="not a multiple of 2 kv heads"):
        decode_attention(torch.randn(1, 5, 16), cache, torch.tensor([0]), torch.tensor([3]))


PREFILL = [v for v in native.available() if v in PREFILL_VARIANTS]
needs_prefill = pytest.mark.skipif(not PREFILL, reason="no kernel variant with AVX512-BF16's dot product on this CPU")


def prefill_reference(q, cache, slots):
    """SDPA's causal attention and the float32 reference, over each row's first T cache positions."""
    t = q.shape[1]
    keys, values = cache[slots, 0, :, :t], cache[slots, 1, :, :t]
    positions = torch.arange(t).expand(q.shape[0], t)
    exact = attention_reference(q.transpose(1, 2).float(), keys.float(), values.float(), positions).transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True, enable_gqa=True)
    return exact, sdpa.transpose(1, 2).float()


@needs_prefill
@pytest.mark.parametrize("variant", PREFILL)
@pytest.mark.parametrize("head_dim, kv_heads, heads", [(64, 3, 9), (128, 2, 16), (96, 1, 3), (32, 4, 4)])
@pytest.mark.parametrize("t", [1, 5, 16, 17, 31, 32, 33, 47, 300])
def test_prefill_attention_matches_the_reference_and_sdpa(variant, head_dim, kv_heads, heads, t):
    """Each query at position p sees positions 0..p of its own slot: lengths on and off the chunks of
    32 keys and the blocks of 16 queries, every head size the kernel takes, groups of 1 to 8 heads,
    rows at scattered slots. What lies past a row's T positions (here: huge values) is never read.
    Against the float32 reference the outputs are as close as SDPA's own bfloat16 ones."""
    cache = torch.randn(4, 2, kv_heads, t + 9, head_dim).to(torch.bfloat16)
    cache[:, :, :, t:] = 1e4
    slots, q = torch.tensor([3, 0]), torch.randn(2, t, heads, head_dim).to(torch.bfloat16)
    with native.using(variant):
        out = prefill_attention(q, cache, slots)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    exact, sdpa = prefill_reference(q, cache, slots)
    torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=2e-2)
    assert (out.float() - exact).abs().max() <= 1.5 * (sdpa - exact).abs().max() + 1e-3


@needs_prefill
def test_prefill_attention_is_causal_and_reads_nothing_past_its_positions():
    """A query at position p depends on positions 0..p alone: a prompt's first T' positions give the
    same bits whatever follows them, even where what follows (and what lies past the prompt in the
    cache) is NaN."""
    cache = torch.randn(2, 2, 3, 120, 64).to(torch.bfloat16)
    q = torch.randn(1, 100, 9, 64).to(torch.bfloat16)
    slots = torch.tensor([1])
    with native.using(PREFILL[0]):
        full = prefill_attention(q, cache, slots)
        for t in (1, 2, 15, 16, 17, 31, 32, 33, 64, 99):
            poisoned = cache.clone()
            poisoned[:, :, :, t:] = float("nan")
            prefix = prefill_attention(q[:, :t], poisoned, slots)
            assert torch.equal(prefix, full[:, :t]), t
            # A later position inside the prompt: the query just before it pairs with it on the dot
            # product, but must not take its NaN in (a zero weight would not keep it out).
            poisoned = cache.clone()
            poisoned[1, :, :, t] = float("nan")
            assert torch.equal(prefill_attention(q, poisoned, slots)[:, :t], full[:, :t]), t


@needs_prefill
def test_prefill_attention_rows_do_not_depend_on_their_company_or_the_threads():
    """Jobs of 16 query positions go to whichever thread is free: each row is bit for bit the same
    alone, beside other rows, and on one thread or two."""
    cache = torch.randn(3, 2, 3, 120, 64).to(torch.bfloat16)
    slots, q = torch.tensor([2, 0]), torch.randn(2, 100, 9, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    with native.using(PREFILL[0]):
        try:
            torch.set_num_threads(2)
            together = prefill_attention(q, cache, slots)
            torch.set_num_threads(1)
            one_thread = prefill_attention(q, cache, slots)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(together, one_thread)
        for row in range(2):
            assert torch.equal(prefill_attention(q[row:row + 1], cache, slots[row:row + 1])[0], together[row])


@needs_prefill
def test_prefill_attention_refuses_what_it_cannot_take():
    cache, q = torch.randn(2, 2, 2, 40, 64).bfloat16(), torch.randn(1, 8, 4, 64).bfloat16()
    with native.using(PREFILL[0]):
        for bad, message in ((dict(slots=torch.tensor([2])), "slot 2 is outside"),
                             (dict(q=torch.randn(1, 41, 4, 64).bfloat16()), "41 positions do not fit"),
                             (dict(q=q.float(), cache=cache.float()), "bfloat16"),
                             (dict(q=torch.randn(1, 8, 4, 80).bfloat16(), cache=torch.randn(2, 2, 2, 40, 80).bfloat16()),
                              "head size 80"),
                             (dict(q=torch.randn(1, 8, 3, 64).bfloat16()), "not a multiple of 2 kv heads")):
            args = dict(q=q, cache=cache, slots=torch.tensor([0])) | bad
            with pytest.raises(RuntimeError, match=message):
                prefill_attention(**args)
    for variant in ("avx2", "avx512"):
        if variant in native.available():
            with native.using(variant), pytest.raises(RuntimeError, match="avx512bf16 and amx kernels only"):
                native.prefill_attention(q, cache, torch.tensor([0]), 0.125, native.variant_index())
