"""RMSNorm, computed in float32 and scaled in the input dtype (as Llama/Qwen reference code does)."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dimension; fused normalisation, which runs in float32 for
    reduced-precision x and rounds once (bit for bit x.float() normalised, then cast)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
