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

from preload_daemon.buffers import typed_view
from preload_daemon.cachekey import CacheKey
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.client import AttachedModel, DaemonClient
from preload_daemon.errors import PreloadError
from preload_daemon.plan import LoadSpec, build_plan, execute
from preload_daemon.store import key_for

log = logging.getLogger(__name__)


class FallbackRefusedError(PreloadError):
    """ipc_cache could not be used and --no-fallback forbids a cold load."""


@dataclasses.dataclass(slots=True)
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
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
    return LoadedWeights(tensors, checkpoint.config, key_for(checkpoint, plan), "safetensors",
                         started=started, finished=time.time())


def load_ipc_cache(request: LoadRequest) -> LoadedWeights:
    started = time.time()
    try:
        checkpoint = Checkpoint(request.spec.path)  # headers only: enough for the expected cache key
        expect = key_for(checkpoint, build_plan(checkpoint, request.spec))
        client = DaemonClient.for_device(request.device, request.runtime_dir, timeout=10)
        attached = client.attach(request.spec.name, expect=expect)
    except PreloadError as e:
        reason = f"ipc_cache unavailable: {type(e).__name__}: {e}"
        if not request.fallback:
            raise FallbackRefusedError(f"{reason} (--no-fallback is set, so no cold load)") from e
        log.warning("%s; falling back to a cold load of %s", reason, request.spec.path)
        weights = load_safetensors(request)
        weights.fallback_reason = reason
        weights.started = started
        return weights
    return LoadedWeights(dict(attached.tensors), attached.config, attached.key, "ipc_cache", attached=attached,
                         started=started, finished=time.time())


LOADERS = {"ipc_cache": load_ipc_cache, "safetensors": load_safetensors}


def load_weights(load_format: str, request: LoadRequest) -> LoadedWeights:
    try:
        loader = LOADERS[load_format]
    except KeyError:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOADERS)}") from None
    return loader(request)
