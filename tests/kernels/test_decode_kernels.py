"""The decode path's kernels against their plain references: rope tables and rotation, attention
over a float32 cache view, the widened reduced-precision product, the norm on reduced precision."""

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import attention_reference, cached_attention
from kernels.dense import Dense, widened_linear
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
    """Keys and values as views of a position-major cache (not contiguous), GQA, rows ending at
    different positions, against the plain reference."""
    cache = torch.randn(batch + 1, s + 5, 2, 2, 16)  # [slots, max_len, k/v, kv heads, D]
    live = cache[1:, :s].permute(2, 0, 3, 1, 4)  # [2, B, KV, S, D]
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


def test_dense_keeps_torch_s_kernel_for_one_row_and_when_asked():
    dense = Dense()
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    assert torch.equal(dense(x[:1], w), F.linear(x[:1], w))
    assert torch.equal(dense(x, w, exact=True), F.linear(x, w))
    torch.testing.assert_close(dense(x, w), F.linear(x, w), rtol=1e-2, atol=1e-2)
    assert torch.equal(dense(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32: torch's GEMM


def test_rms_norm_on_bfloat16_equals_the_float32_path_bit_for_bit():
    x = (torch.randn(4096, 576) * torch.rand(4096, 1) * 30).bfloat16()
    w = torch.randn(576).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5), w * F.rms_norm(x.float(), (576,), eps=1e-5).bfloat16())
