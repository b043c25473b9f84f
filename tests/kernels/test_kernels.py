"""Every kernel against its plain reference."""

import pytest
import torch

from kernels.activation import silu_mul, silu_mul_reference
from kernels.attention import attention, attention_reference
from kernels.norm import rms_norm, rms_norm_reference
from kernels.rope import apply_rope, apply_rope_reference, cos_sin, inv_freq


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm(dtype, tol):
    x = torch.randn(3, 5, 64, dtype=dtype) * 7
    w = torch.randn(64, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=tol, atol=tol)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_matches_complex_rotation(scaling):
    freqs = inv_freq(32, 10000.0, scaling)
    positions = torch.tensor([[0, 1, 2, 3], [7, 50, 100, 300]])
    x = torch.randn(2, 3, 4, 32)
    cos, sin = cos_sin(freqs, positions, x.dtype)
    # The kernel forms angles in float32, as the checkpoints' own code does; at position 300 that
    # costs ~1e-5 radians against the float64 reference.
    torch.testing.assert_close(apply_rope(x, cos, sin), apply_rope_reference(x, freqs, positions),
                               rtol=1e-4, atol=2e-4)


def test_llama3_scaling_changes_only_low_frequencies():
    base = inv_freq(64, 500000.0)
    scaled = inv_freq(64, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert torch.equal(scaled[:4], base[:4])
    torch.testing.assert_close(scaled[-1], base[-1] / 8)


def test_unknown_rope_type():
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported; supported: default, linear"):
        inv_freq(32, 1e4, {"rope_type": "dynamic"})


@pytest.mark.parametrize("batch, t, s", [(1, 9, 9), (3, 1, 12), (2, 4, 10)])
def test_attention_gqa_with_cache_positions(batch, t, s):
    q = torch.randn(batch, 8, t, 16)
    k, v = torch.randn(batch, 2, s, 16), torch.randn(batch, 2, s, 16)
    # Each sequence's queries end at a different cache length.
    ends = torch.tensor([s - 1 - i for i in range(batch)])
    positions = ends[:, None] - torch.arange(t - 1, -1, -1)[None, :]
    torch.testing.assert_close(attention(q, k, v, positions), attention_reference(q, k, v, positions),
                               rtol=1e-5, atol=1e-5)


def test_silu_mul():
    g, u = torch.randn(4, 32), torch.randn(4, 32)
    torch.testing.assert_close(silu_mul(g, u), silu_mul_reference(g, u), rtol=1e-6, atol=1e-6)
