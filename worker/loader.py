"""Weight loaders, one strategy per load format behind a registry keyed by `--load-format`:

- `safetensors`: the cold path. Runs the daemon's own load plan into private memory.
- `ipc_cache`: asks the daemon for the variant it wants (by the checkpoint files it was started on,
  or by version) and maps it zero-copy under a lease; the daemon owns the layout decisions and
  answers with the matching variant or a mismatch naming the fields. Falls back to the cold path
  with a logged reason unless fallback is off.
"""

import dataclasses
import logging
import pathlib
import threading
import time
from typing import TYPE_CHECKING

import torch

from kernels.quant import QuantizedWeight
from preload_daemon.arch import ArchSpec
from preload_daemon.buffers import SlabViews
from preload_daemon.checkpoint import Checkpoint, stat_identity
from preload_daemon.config import cuda_ordinal
from preload_daemon.errors import (DaemonUnavailableError, DeviceError, LoadingError, NotFoundError, PreloadError,
                                   StaleError)
from preload_daemon.execute import execute
from preload_daemon.hfconfig import read_config
from preload_daemon.plan import LoadPlan, LoadSpec, build_plan

if TYPE_CHECKING:  # the client (protobuf) is imported when an engine attaches, not by a cold engine
    from preload_daemon.attached import AttachedModel

log = logging.getLogger(__name__)
RETRY_S = 0.2


class FallbackRefusedError(PreloadError):
    """ipc_cache could not be used and --no-fallback (or --weights-version) forbids a cold load."""


@dataclasses.dataclass(slots=True)
class LoadedWeights:
    tensors: dict[str, torch.Tensor | QuantizedWeight]
    """By checkpoint name; a quantized projection is one QuantizedWeight over its slab parts."""
    config: dict
    load_format: str
    """The format actually used (ipc_cache may have fallen back to safetensors)."""
    version: int = 0
    """The daemon's version of the weights; 0 for a cold load."""
    content_digest: str = ""
    """The digest of the slab's bytes (ipc_cache)."""
    fallback_reason: str = ""
    attached: "AttachedModel | None" = None
    started: float = 0.0
    finished: float = 0.0


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class LoadRequest:
    spec: LoadSpec
    device: str = "cpu:0"
    runtime_dir: pathlib.Path | None = None
    fallback: bool = True
    weights_version: str = ""
    """"" (the version loaded from spec.path's files), "active", or a version number."""
    allow_external: bool = False
    """Checkpoint files may link outside the model directory (checkpoint.Checkpoint)."""
    wait_for_daemon: float = 0.0
    """Seconds to keep asking a daemon that is absent or still loading before giving up."""


def check_device(device: str) -> torch.device:
    """The torch device of "cpu:N" or "cuda:N"; DeviceError where this process cannot use that GPU."""
    ordinal = cuda_ordinal(device)
    if ordinal is None:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{device}: this process has no usable GPU (torch.cuda.is_available() is False: a CPU "
                          "build of torch, no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them); use cpu:N devices, "
                          "or install a CUDA build of torch (scripts/setup.sh does where nvidia-smi works)")
    if ordinal >= torch.cuda.device_count():
        raise DeviceError(f"{device} does not exist: this process sees {torch.cuda.device_count()} GPU(s) "
                          "(CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return torch.device("cuda", ordinal)


def read_cold(spec: LoadSpec, allow_external: bool = False) -> tuple[LoadPlan, torch.Tensor, dict]:
    """The cold path's read: `spec`'s load plan executed into private memory, the kernel reading the
    files ahead while the plan is made where the load reads every file. (plan, slab, config.json)."""
    checkpoint = Checkpoint(spec.path, allow_external=allow_external, read_ahead=spec.reads_every_file)
    try:
        plan = build_plan(checkpoint, spec)
        slab = torch.empty(plan.total_bytes, dtype=torch.uint8)
        execute(plan, checkpoint, slab)
    finally:
        checkpoint.close()
    return plan, slab, checkpoint.config


def load_safetensors(request: LoadRequest) -> LoadedWeights:
    started = time.time()
    plan, slab, config = read_cold(request.spec, request.allow_external)
    if request.device.startswith("cuda:"):  # the same bytes the daemon's cuda slab would hold
        slab = slab.to(check_device(request.device))
    views = SlabViews(slab)
    tensors = {e.name: views.view(e.offset, e.nbytes, e.dtype, e.shape) for e in plan.entries}
    parts = [(e.name, e.part, e.quant_scheme, dict(e.quant_params)) for e in plan.entries if e.part == "weight"]
    return LoadedWeights(assemble(tensors, parts), config, "safetensors", started=started,
                         finished=time.time())


def load_ipc_cache(request: LoadRequest) -> LoadedWeights:
    started = time.time()
    try:
        attached = attach(request)
    except PreloadError as e:
        reason = f"ipc_cache unavailable: {type(e).__name__}: {e}"
        if request.weights_version:
            raise FallbackRefusedError(f"{reason} (--weights-version {request.weights_version} asks for the daemon's "
                                       "weights; a cold load of the checkpoint could be other weights)") from e
        if not request.fallback:
            raise FallbackRefusedError(f"{reason} (--no-fallback is set, so no cold load)") from e
        log.warning("%s; falling back to a cold load of %s", reason, request.spec.path)
        weights = load_safetensors(request)
        weights.fallback_reason = reason
        weights.started = started
        return weights
    parts = [(t.name, t.part, t.quant_scheme, dict(t.quant_params)) for t in attached.manifest.tensors
             if t.part == "weight"]
    return LoadedWeights(assemble(attached.tensors, parts), attached.config, "ipc_cache",
                         version=attached.version, content_digest=attached.key.content_digest, attached=attached,
                         started=started, finished=time.time())


def attach(request: LoadRequest) -> "AttachedModel":
    """The daemon's variant for this request, leased; retries an absent or loading daemon for
    request.wait_for_daemon seconds. Checks that the weights fit the engine's config.json."""
    from preload_daemon.client import DaemonClient
    spec = request.spec
    by_version = request.weights_version not in ("", "active")
    version = int(request.weights_version) if by_version else 0
    files = stat_identity(spec.path, allow_external=request.allow_external) if not request.weights_version else ()
    deadline = time.monotonic() + request.wait_for_daemon
    waited = False
    client = DaemonClient.for_device(request.device, request.runtime_dir, timeout=10)  # renews the lease later
    try:
        while True:
            try:
                attached = client.attach(spec.name, version, spec.layout, files)
                break
            except (DaemonUnavailableError, LoadingError, NotFoundError) as e:
                if time.monotonic() + RETRY_S > deadline:
                    raise
                if not waited:
                    log.info("waiting up to %gs for the daemon on %s: %s", request.wait_for_daemon, request.device, e)
                    waited = True
                time.sleep(RETRY_S)
        problems = ArchSpec.from_config(attached.config, f"{spec.name} v{attached.version}").differences(
            ArchSpec.from_config(read_config(spec.path), f"{spec.path}/config.json"))
        if problems:
            attached.release()
            raise StaleError(f"{spec.name} v{attached.version} on {request.device} does not fit this engine's "
                             f"config.json: {', '.join(problems)} (daemon vs engine)")
    except BaseException:
        client.close()
        raise
    return attached


LEASE_CHECK_S = 5.0  # how often a keeper asks the daemon whether its lease still stands


class LeaseKeeper:
    """Keeps an ipc_cache attachment leased across daemon restarts. When the daemon goes away (its
    session closes), the mapped host slab stays valid, so the engine goes on serving and reports
    itself degraded; the keeper asks every `retry_s` for the same weights (version and layout) from
    whichever daemon comes back on the device, and once one holds them (a daemon that adopted the
    slab, or reloaded the same bytes: equal content digest) takes a new lease there. A lease the
    daemon ended while running (its version evicted with --force) is found within LEASE_CHECK_S and
    handled alike: the engine had gone on saying alive, holding no lease.

    Device memory (a CUDA slab) dies with its daemon, and nothing re-attaches the model's views to a
    new allocation: the keeper marks the loss `fatal`, and the engine stops reporting ready."""

    def __init__(self, weights: LoadedWeights, device: str, runtime_dir: pathlib.Path | None, retry_s: float = 0.5):
        self.weights, self.device, self.runtime_dir, self.retry_s = weights, device, runtime_dir, retry_s
        self.lost = ""
        """Why the lease is gone, while it is; "" while attached."""
        self.fatal = False
        """The lost lease's memory may be gone with its daemon (not host memory): never serve again."""
        self.reattached = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LeaseKeeper":
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()
        return self

    def stop(self, join: bool = False) -> None:
        """Stops watching; with `join`, returns once the watcher thread has ended (within ~1 s)."""
        self._stop.set()
        if join and self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        next_check = time.monotonic() + LEASE_CHECK_S
        while not self._stop.is_set():
            attached = self.weights.attached
            ended = ""  # the daemon runs, but ended the lease (a forced evict of its version)
            if not attached.wait_lost(1.0):
                if time.monotonic() < next_check:
                    continue
                next_check = time.monotonic() + LEASE_CHECK_S
                try:
                    attached.renew(timeout=2.0)  # (stop(join=True) waits for this)
                    continue
                except NotFoundError as e:
                    ended = str(e)
                except PreloadError:  # busy, or going away: the session's close says the latter
                    continue
            what = f"{attached.manifest.model} v{attached.version} ({attached.layout})"
            loss = f"the daemon on {self.device} ended the lease of {what} ({ended})" if ended else \
                f"lost the daemon on {self.device}, which leased {what}"
            if attached.in_device_memory:
                self.fatal = True
                self.lost = f"{loss}, whose device memory the daemon freed; restart this engine" if ended else \
                    f"lost the daemon on {self.device}, which held {what} in device memory that died with it; " \
                    "restart this engine"
                log.error("%s", self.lost)
                return
            self.lost = f"{loss}; serving from the mapped slab and re-attaching when a daemon holds it again"
            log.warning("%s", self.lost)
            delay = self.retry_s
            while not self._stop.wait(delay):
                try:
                    self.weights.attached = self._reattach(attached)
                    attached.close()
                except Exception as e:  # a daemon not back yet, or anything else: keep trying
                    if not isinstance(e, PreloadError):
                        log.warning("re-attaching %s failed: %s: %s", what, type(e).__name__, e)
                    self.lost = self.lost.split("; last try:")[0] + f"; last try: {e}"
                    # A daemon that answers without these weights is asked less often (each try is a
                    # session and an attach on it).
                    delay = LEASE_CHECK_S if isinstance(e, (NotFoundError, StaleError)) else self.retry_s
                    continue
                # A daemon that loaded the files again numbered them anew: the engine's answers name the
                # version the daemon holds these bytes as now (the old number may hold other weights there).
                renumbered = self.weights.attached.version != attached.version
                self.weights.version = self.weights.attached.version
                self.lost = ""
                self.reattached += 1
                log.info("re-attached %s on %s with a new lease%s", what, self.device,
                         f", as v{self.weights.version} (the same bytes)" if renumbered else "")
                break

    def _reattach(self, old: "AttachedModel") -> "AttachedModel":
        """The same weights from the device's daemon now: the same version number (a daemon that
        adopted the slab), else the version loaded from the same files (a daemon that loaded them
        again numbered them anew); accepted only with the same content digest."""
        from preload_daemon.client import DaemonClient
        client = DaemonClient.for_device(self.device, self.runtime_dir, timeout=5)
        try:
            try:
                new = client.attach(old.manifest.model, old.version, old.layout)
            except (NotFoundError, StaleError):
                if not old.key.files:
                    raise
                new = client.attach(old.manifest.model, 0, old.layout, old.key.files)
            if new.key.content_digest != old.key.content_digest:
                raise StaleError(f"the daemon holds other bytes for {old.manifest.model} v{new.version} "
                                 f"({new.key.content_digest} vs {old.key.content_digest})")
        except BaseException:
            client.close()  # its session ends any lease it took
            raise
        return new


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
    check_device(request.device)
    return loader(request)
