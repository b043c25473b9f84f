"""Weight loaders, one strategy per load format behind a registry keyed by `--load-format`:

- `safetensors`: the cold path. Runs the daemon's own load plan into private memory.
- `ipc_cache`: attaches to the daemon's slab (zero-copy, leased) after checking the cache key;
  falls back to the cold path with a logged reason unless fallback is off.
"""

import dataclasses
import logging
import pathlib
import time

import torch

from kernels.quant import QuantizedWeight
from preload_daemon.buffers import typed_view
from preload_daemon.cachekey import CacheKey
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.client import AttachedModel, DaemonClient
from preload_daemon.errors import PreloadError
from preload_daemon.execute import execute
from preload_daemon.plan import LoadSpec, build_plan
from preload_daemon.store import key_for

log = logging.getLogger(__name__)


class FallbackRefusedError(PreloadError):
    """ipc_cache could not be used and --no-fallback forbids a cold load."""


@dataclasses.dataclass(slots=True)
class LoadedWeights:
    tensors: dict[str, torch.Tensor | QuantizedWeight]
    """By checkpoint name; a quantized projection is one QuantizedWeight over its slab parts."""
    config: dict
    key: CacheKey
    load_format: str
    """The format actually used (ipc_cache may have fallen back to safetensors)."""
    fallback_reason: str = ""
    attached: AttachedModel | None = None
    started: float = 0.0
    finished: float = 0.0


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class LoadRequest:
    spec: LoadSpec
    device: str = "cpu:0"
    runtime_dir: pathlib.Path | None = None
    fallback: bool = True


def load_safetensors(request: LoadRequest) -> LoadedWeights:
    started = time.time()
    checkpoint = Checkpoint(request.spec.path)
    try:
        plan = build_plan(checkpoint, request.spec)
        slab = torch.empty(plan.total_bytes, dtype=torch.uint8)
        execute(plan, checkpoint, slab)
    finally:
        checkpoint.close()
    tensors = {e.name: typed_view(slab, e.offset, e.nbytes, e.dtype, e.shape) for e in plan.entries}
    parts = [(e.name, e.part, e.quant_scheme, dict(e.quant_params)) for e in plan.entries]
    return LoadedWeights(assemble(tensors, parts), checkpoint.config, key_for(checkpoint, plan), "safetensors",
                         started=started, finished=time.time())


def load_ipc_cache(request: LoadRequest) -> LoadedWeights:
    started = time.time()
    client = None
    try:
        checkpoint = Checkpoint(request.spec.path)  # headers only: enough for the expected cache key
        expect = key_for(checkpoint, build_plan(checkpoint, request.spec))
        client = DaemonClient.for_device(request.device, request.runtime_dir, timeout=10)
        attached = client.attach(request.spec.name, expect=expect)
    except PreloadError as e:
        if client is not None:
            client.close()
        reason = f"ipc_cache unavailable: {type(e).__name__}: {e}"
        if not request.fallback:
            raise FallbackRefusedError(f"{reason} (--no-fallback is set, so no cold load)") from e
        log.warning("%s; falling back to a cold load of %s", reason, request.spec.path)
        weights = load_safetensors(request)
        weights.fallback_reason = reason
        weights.started = started
        return weights
    parts = [(t.name, t.part, t.quant_scheme, dict(t.quant_params)) for t in attached.manifest.tensors]
    return LoadedWeights(assemble(dict(attached.tensors), parts), attached.config, attached.key, "ipc_cache",
                         attached=attached, started=started, finished=time.time())


def assemble(tensors: dict[str, torch.Tensor], parts) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Groups the slab parts of each quantized weight (name, part, scheme, params) into one
    QuantizedWeight under the weight's own name; other tensors pass through."""
    out = dict(tensors)
    for name, part, scheme, params in parts:
        if part != "weight":
            continue
        stem = name.removesuffix(".weight")
        out[name] = QuantizedWeight(scheme, tensors[name], out.pop(f"{stem}.weight_scale"),
                                    out.pop(f"{stem}.weight_global_scale", None),
                                    (tensors[name].shape[0], int(params["in_features"])))
    return out


LOADERS = {"ipc_cache": load_ipc_cache, "safetensors": load_safetensors}


def load_weights(load_format: str, request: LoadRequest) -> LoadedWeights:
    try:
        loader = LOADERS[load_format]
    except KeyError:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOADERS)}") from None
    return loader(request)
