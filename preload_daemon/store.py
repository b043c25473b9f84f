"""The model store: loaded model versions, their slabs, their leases. Thread-safe; the gRPC
servicer is a thin layer over it."""

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from preload_daemon.cachekey import CacheKey, file_differences
from preload_daemon.checkpoint import Checkpoint, refresh_identity
from preload_daemon.errors import LeasedError, NotFoundError, StaleError
from preload_daemon.leases import Lease
from preload_daemon.execute import execute
from preload_daemon.plan import FORMAT_VERSION, SCHEME_PARAMS, LoadPlan, LoadSpec, build_plan
from preload_daemon.slab import DIGEST_ALGORITHM, HostSlab, new_hasher

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class LoadProgress:
    stage: str
    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0


@dataclasses.dataclass(slots=True)
class ModelVersion:
    name: str
    version: int
    spec: LoadSpec
    plan: LoadPlan
    key: CacheKey
    slab: HostSlab
    config_json: str
    loaded_at: float
    load_seconds: float
    leases: dict[str, Lease] = dataclasses.field(default_factory=dict)
    stale_reason: str = ""

    @property
    def state(self) -> str:
        return "stale" if self.stale_reason else "ready"


class ModelStore:
    def __init__(self, device: str, shm_dir, on_change: Callable[[], None] = lambda: None):
        self.device = device
        self.shm_dir = shm_dir
        self._on_change = on_change
        self._lock = threading.Lock()
        self._versions: dict[str, dict[int, ModelVersion]] = {}
        self._active: dict[str, int] = {}
        self._last_version: dict[str, int] = {}  # versions are never reused, even after eviction
        self._loading: dict[LoadSpec, threading.Event] = {}
        self._leases: dict[str, Lease] = {}

    # -- loading ---------------------------------------------------------------------------------

    def load(self, spec: LoadSpec, on_progress: Callable[[LoadProgress], None] = lambda p: None) -> ModelVersion:
        """Loads the checkpoint as a new version, or returns the loaded version whose cache key
        matches the checkpoint as it is on disk now. Concurrent loads of one spec run once."""
        while True:
            with self._lock:
                pending = self._loading.get(spec)
                if pending is None:
                    self._loading[spec] = threading.Event()
                    break
            on_progress(LoadProgress("queued"))
            pending.wait()
        self._on_change()
        try:
            return self._load_once(spec, on_progress)
        finally:
            with self._lock:
                self._loading.pop(spec).set()
            self._on_change()

    def _load_once(self, spec: LoadSpec, on_progress) -> ModelVersion:
        checkpoint = Checkpoint(spec.path)
        try:
            plan = build_plan(checkpoint, spec)
            key = key_for(checkpoint, plan)
            existing = self._find(spec.name, key)
            if existing is not None:
                log.info("model %s v%d already loaded on %s with the same cache key", spec.name,
                         existing.version, self.device)
                return existing
            return self._materialise(spec, checkpoint, plan, key, on_progress)
        finally:
            checkpoint.close()

    def _materialise(self, spec, checkpoint, plan, key, on_progress) -> ModelVersion:
        start = time.monotonic()
        with self._lock:
            version = self._last_version[spec.name] = self._last_version.get(spec.name, 0) + 1
        label = f"{self.device.replace(':', '')}-{spec.name}-v{version}-r{spec.tp_rank}-{spec.component}"
        slab = HostSlab.create(self.shm_dir, label, plan.total_bytes)
        progress = LoadProgress("reading", 0, plan.tensor_bytes, 0, len(plan.entries))
        on_progress(progress)

        def on_tensor(entry) -> None:
            progress.bytes_done += entry.nbytes
            progress.tensors_done += 1
            on_progress(progress)

        hasher = new_hasher()
        try:
            execute(plan, checkpoint, slab.data, on_tensor=on_tensor, hasher=hasher)
        except BaseException:
            slab.close()
            slab.unlink()
            raise
        slab.seal(f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}")
        key = dataclasses.replace(key, content_digest=slab.digest)
        seconds = time.monotonic() - start
        model = ModelVersion(spec.name, version, spec, plan, key, slab, json.dumps(checkpoint.config),
                             time.time(), seconds)
        with self._lock:
            self._versions.setdefault(spec.name, {})[version] = model
            self._active[spec.name] = version
        log.info("loaded %s v%d on %s rank %d/%d: %d tensors, %.1f MiB in %.2fs (%.2f GB/s)", spec.name, version,
                 self.device, spec.tp_rank, spec.tp_size, len(plan.entries), plan.total_bytes / 2**20, seconds,
                 plan.tensor_bytes / max(seconds, 1e-9) / 1e9)
        on_progress(LoadProgress("ready", plan.tensor_bytes, plan.tensor_bytes, len(plan.entries),
                                 len(plan.entries)))
        return model

    def _find(self, name: str, key: CacheKey) -> ModelVersion | None:
        """The newest fresh version of `name` whose key matches."""
        with self._lock:
            for _, model in sorted(self._versions.get(name, {}).items(), reverse=True):
                if not model.stale_reason and not model.key.differences(key):
                    return model
        return None

    # -- attaching ----------------------------------------------------------------------------------

    def attach(self, name: str, version: int, pid: int, expect: CacheKey | None = None) -> tuple[ModelVersion, Lease]:
        """Leases a version: the one asked for, else the newest whose key matches `expect`, else the
        active one. A key mismatch is an error naming the fields that differ."""
        model = self.get(name, version)
        if expect is not None and not version:
            model = self._find(name, expect) or model
        self._check_fresh(model)
        if expect is not None:
            diffs = model.key.differences(expect)
            if diffs:
                raise StaleError(f"{name} v{model.version} on {self.device} does not match the caller's cache key: "
                                 f"{', '.join(diffs)}; load the checkpoint you expect with `preload serve`")
        with self._lock:
            if model.version not in self._versions.get(name, {}):
                raise NotFoundError(f"{name} v{model.version} was evicted while attaching; attach again")
            lease = Lease.new(pid, name, model.version)
            model.leases[lease.id] = lease
            self._leases[lease.id] = lease
        log.info("lease %s: pid %d attached %s v%d on %s", lease.id, pid, name, model.version, self.device)
        return model, lease

    def _check_fresh(self, model: ModelVersion) -> None:
        """Refuses a version whose checkpoint files changed on disk since it was loaded: a
        checkpoint rewritten in place must never be served as the old one."""
        if not model.stale_reason:
            now = refresh_identity(model.key.files)
            diffs = file_differences(now, tuple(model.key.files))
            if diffs:
                model.stale_reason = f"checkpoint changed on disk since it was loaded: {', '.join(diffs)}"
                self._on_change()
        if model.stale_reason:
            raise StaleError(f"{model.name} v{model.version} on {self.device} is stale ({model.stale_reason}); "
                             f"load it again with `preload serve {model.spec.path}`")

    def renew(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise NotFoundError(f"lease {lease_id} is unknown or was reaped; attach again")
            lease.renewed_at = time.time()
            return lease

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise NotFoundError(f"lease {lease_id} is unknown or was already released")
            model = self._versions.get(lease.model, {}).get(lease.version)
            if model is not None:
                model.leases.pop(lease_id, None)
        log.info("lease %s released by pid %d", lease_id, lease.pid)

    def reap(self) -> list[Lease]:
        """Drops the leases of processes that are gone; returns them."""
        with self._lock:
            leases = list(self._leases.values())
        dead = [lease for lease in leases if not lease.holder_alive()]
        for lease in dead:
            try:
                self.release(lease.id)
            except NotFoundError:
                continue
            log.info("reaped lease %s of dead pid %d (%s v%d)", lease.id, lease.pid, lease.model, lease.version)
        return dead

    # -- versions ------------------------------------------------------------------------------------

    def get(self, name: str, version: int = 0) -> ModelVersion:
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                loaded = ", ".join(sorted(self._versions)) or "none"
                raise NotFoundError(f"model {name!r} is not loaded on {self.device} (loaded: {loaded}); "
                                    f"load it with `preload serve`")
            version = version or self._active[name]
            if version not in versions:
                raise NotFoundError(f"{name} has no version {version} on {self.device}; versions: "
                                    f"{', '.join(map(str, sorted(versions)))}")
            return versions[version]

    def evict(self, name: str, version: int = 0, force: bool = False) -> list[ModelVersion]:
        """Removes one version (or all, version=0). Leased versions need force; their mapped pages
        stay valid in the processes that hold them."""
        with self._lock:
            versions = self._versions.get(name)
            if not versions or (version and version not in versions):
                what = f"{name} v{version}" if version else repr(name)
                raise NotFoundError(f"{what} is not loaded on {self.device}; see `preload status`")
            victims = [versions[version]] if version else list(versions.values())
            leased = [m for m in victims if m.leases]
            if leased and not force:
                holders = sorted({lease.pid for m in leased for lease in m.leases.values()})
                raise LeasedError(f"{name} is leased by pid {', '.join(map(str, holders))} on {self.device}; "
                                  "stop those workers first, or pass --force (their mappings stay valid)")
            for model in victims:
                del versions[model.version]
                for lease_id in model.leases:
                    self._leases.pop(lease_id, None)
            if not versions:
                del self._versions[name]
                del self._active[name]
            elif self._active[name] not in versions:
                self._active[name] = max(versions)
        for model in victims:
            model.slab.close()
            model.slab.unlink()
            log.info("evicted %s v%d from %s (%.1f MiB freed)", name, model.version, self.device,
                     model.slab.size / 2**20)
        self._on_change()
        return victims

    def models(self) -> list[tuple[ModelVersion, bool]]:
        """Every version with whether it is the active one."""
        with self._lock:
            return [(m, self._active[name] == v) for name, versions in sorted(self._versions.items())
                    for v, m in sorted(versions.items())]

    def is_loading(self) -> bool:
        with self._lock:
            return bool(self._loading)

    def close(self) -> None:
        """Frees every slab (graceful daemon shutdown)."""
        for model, _ in self.models():
            model.slab.close()
            model.slab.unlink()
        with self._lock:
            self._versions.clear()
            self._active.clear()
            self._leases.clear()


def key_for(checkpoint: Checkpoint, plan: LoadPlan) -> CacheKey:
    """The cache key of a plan over a checkpoint, without the content digest (known after loading)."""
    spec = plan.spec
    return CacheKey(files=tuple(checkpoint.identity), architecture=plan.architecture, tp_size=spec.tp_size,
                    tp_rank=spec.tp_rank, dtype=str(plan.dtype).removeprefix("torch."),
                    quantization=spec.quantization, component=spec.component, format_version=FORMAT_VERSION,
                    quant_params=tuple(sorted(SCHEME_PARAMS.get(spec.quantization, {}).items())))
