"""RMSNorm, computed in float32 and scaled in the input dtype (as Llama/Qwen reference code does).

On CPU the native kernels' norm where they are built (kernels/csrc/decode.cpp: a few microseconds,
where torch's fused rms_norm costs 30-40 us a call whatever the size, 61 calls a token for the
default model); else torch's. The two sum the squares in different orders, so an element may
differ in its last bit."""

import torch
import torch.nn.functional as F

from kernels import native

_NATIVE = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dimension; the normalisation runs in float32 for
    reduced-precision x and rounds once (x.float() normalised, then cast)."""
    if native.rms_norm is not None and x.dtype == weight.dtype and x.dtype in _NATIVE and not x.is_cuda:
        if x.dim() == 2 and x.stride(1) == 1:  # the model's rows: no reshaping (each costs microseconds)
            return native.rms_norm(x, weight, eps)
        return native.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
