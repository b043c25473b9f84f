"""The optional native CPU kernels (kernels/csrc, built by scripts/build_kernels.py on AVX-512
machines). `qgemv` and `qgemm` are None where the library was not built; callers then use pure
torch."""

import os

import torch

_LIBRARY = os.path.join(os.path.dirname(__file__), "_native", "libpreload_kernels.so")


def _load():
    if not os.path.exists(_LIBRARY):
        return None, None
    torch.ops.load_library(_LIBRARY)
    return torch.ops.preload.qgemv, torch.ops.preload.qgemm


qgemv, qgemm = _load()
