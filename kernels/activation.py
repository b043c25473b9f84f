"""The SwiGLU gate: silu(gate) * up."""

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g / (1 + torch.exp(-g)) * up.float()).to(gate.dtype)
