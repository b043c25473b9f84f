"""The model store: models, their versions and variants, slabs, leases and retention. Thread-safe;
the gRPC servicer is a thin layer over it. Loads of a model run one at a time (loading.py); which
version a request means is matching.py's to say; the leases are kept in leasing.py's book.

- A model name has immutable versions (weights content: the checkpoint files a version was loaded
  from, or the tensors a trainer streamed) and one active pointer.
- A version has variants (dtype, quantization, TP size and rank, component), each its own slab and
  cache key. Loading another variant of a version never creates a version or moves the pointer.
- Nothing leased, pinned or active is ever freed by retention: of the other versions, the newest
  `keep` stay and older ones go, and a load that would break the byte budget first frees the
  oldest of them or fails."""

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from preload_daemon import adopt, stream
from preload_daemon.arch import ArchSpec
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import DeviceError, LeasedError, LoadingError, NotFoundError, PlanError, StaleError
from preload_daemon.execute import execute
from preload_daemon.fill import Filler, free_slab
from preload_daemon.hfconfig import parse_config
from preload_daemon.leases import Lease
from preload_daemon.leasing import Leases
from preload_daemon.loading import Loading, Loads
from preload_daemon.matching import find_model, find_version, new_number, pick_version, version_for
from preload_daemon.plan import Layout, LoadPlan, LoadSpec, build_plan
from preload_daemon.records import (LoadProgress, Model, Retention, Variant, Version, budget_victims, evictable,
                                    check_slab_files, pick_variant, unique_plans)
from preload_daemon.safetensors_file import FileIdentity
from preload_daemon.sessions import Session
from preload_daemon.slab import Slab, backend_for, rehash

log = logging.getLogger(__name__)


class ModelStore:
    def __init__(self, device: str, shm_dir, on_change: Callable[[], None] = lambda: None,
                 allow_external: bool = False, load_timeout_s: float = 3600.0):
        self.device = device
        self.load_timeout_s = load_timeout_s
        """A load or publish still running after this long fails and frees what it made."""
        self.allow_external = allow_external
        """Checkpoint files may link outside their directory (checkpoint.Checkpoint)."""
        self.shm_dir = shm_dir
        self.backend = backend_for(device, shm_dir)
        """Where its slabs live (slab.py): raises DeviceError here for a device this host lacks."""
        self._notify = on_change
        self._lock = threading.RLock()
        self.lock = self._lock
        """Held while reading several records at once (status, metrics); never held long."""
        self._models: dict[str, Model] = {}
        self.leases = Leases(self._lock, self._retain)
        """Renew, release, end_session and reap are the lease book's (leasing.py)."""
        self._loads = Loads(device, self._lock, self._models, self._on_change)
        self.recovery: list[str] = []
        """What was adopted from, or discarded of, a previous daemon's slabs (adopt.py)."""
        self.adopted_bytes, self.adoption_seconds = 0, 0.0

    def adopt(self) -> adopt.Adopted:
        """Takes over the slabs a previous daemon on this device left (its caller holds the
        device's lock, so no live daemon owns them)."""
        found = adopt.adopt(self.shm_dir, self.device)
        with self._lock:
            self._models.update(found.models)
            self.recovery = found.report
            self.adopted_bytes, self.adoption_seconds = found.bytes, found.seconds
        for line in found.report:
            log.info("recovery on %s: %s", self.device, line)
        if found.models:
            log.info("adopted %d model(s), %.1f MiB on %s in %.3fs, without reading a checkpoint", len(found.models),
                     found.bytes / 2**20, self.device, found.seconds)
        self._on_change()
        return found

    def _on_change(self) -> None:
        """After every change: saves the pointers for a daemon that adopts these slabs; tells the server."""
        with self._lock:
            try:
                self._write_state()
            except OSError as e:
                log.warning("cannot save the model pointers in %s: %s (a restarted daemon would activate the newest "
                            "versions)", self.shm_dir, e)
        self._notify()

    # -- loading from a directory -------------------------------------------------------------------

    def load(self, spec: LoadSpec, layouts: tuple[Layout, ...] = (), version: int = 0, activate: bool = True,
             retention: Retention = Retention(),
             on_progress: Callable[[LoadProgress], None] = lambda p: None) -> list[Variant]:
        """Loads `spec`'s layout and `layouts` of the checkpoint at spec.path: into the version loaded
        from the same files if there is one, else into a new version (numbered `version`, or the
        next), which becomes active if `activate` or if it is the model's first. Returns the variants
        in the order asked; a failure frees whatever this call made."""
        with Loading(self._loads, self._model(spec.name, create=True), version, on_progress) as loading:
            model = loading.model
            loading.set_retention(retention)
            checkpoint = Checkpoint(spec.path, allow_external=self.allow_external, read_ahead=spec.reads_every_file)
            try:
                with self._lock:
                    target = loading.number = version_for(model, tuple(checkpoint.identity), version, self.device)
                plans = unique_plans([build_plan(checkpoint, spec.with_layout(layout)) for layout in (spec.layout, *layouts)])
                return self._fill(model, target, plans, activate, on_progress,
                                  lambda plan, slab, on_tensor, hasher: execute(plan, checkpoint, slab.data,
                                                                                on_tensor=on_tensor, hasher=hasher,
                                                                                ready=slab.allocated),
                                  source=lambda: (str(checkpoint.path), tuple(checkpoint.identity),
                                                  json.dumps(checkpoint.config)))
            finally:
                checkpoint.close()

    # -- publishing from a stream -------------------------------------------------------------------

    def publish_stream(self, table: stream.StreamedCheckpoint, name: str, chunks, version: int = 0,
                       layouts: tuple[Layout, ...] = (), activate: bool = False, retention: Retention = Retention(),
                       on_progress: Callable[[LoadProgress], None] = lambda p: None) -> list[Variant]:
        """A new version from tensors streamed by a live process (stream.py), in `layouts`, else those
        of the active version on this device, else the default layout."""
        # A stream cannot queue (wait=False): its sender would time out.
        with Loading(self._loads, self._model(name, create=True), version, on_progress, wait=False) as loading:
            model = loading.model
            loading.set_retention(retention)
            with self._lock:
                number = loading.number = new_number(model, version, self.device)
                active = model.versions.get(model.active)
                layouts = list(layouts) or (list(active.variants) if active is not None else [Layout()])
            spec = LoadSpec(path=table.path, name=model.name)
            plans = unique_plans([build_plan(table, spec.with_layout(layout)) for layout in layouts])

            def fill_all(targets: list[tuple[LoadPlan, Slab]], on_tensor) -> None:
                stream.fill(table, [(plan, slab.data) for plan, slab in targets], chunks, on_tensor)

            return self._fill(model, number, plans, activate, on_progress, None,
                              source=lambda: (table.path, (), json.dumps(table.config)), fill_all=fill_all,
                              tensors_total=len(table.order), bytes_total=sum(t.nbytes for t in table.order))

    # -- making variants ----------------------------------------------------------------------------

    def _fill(self, model: Model, target: Version | int, plans: list[LoadPlan], activate: bool, on_progress,
              execute_one, source, fill_all=None, tensors_total: int = 0, bytes_total: int = 0) -> list[Variant]:
        """Creates the version if `target` is a number, then the plans' variants that it lacks. On
        any failure, everything this call created is freed and the failure recorded."""
        created = not isinstance(target, Version)
        if created:
            path, files, config_json = source()
            target = Version(model, target, path, files, config_json,
                             ArchSpec.from_config(parse_config(config_json, path), path), time.time(), creating=True)
        number = target.number
        existing = {p.layout: target.variants.get(p.layout) for p in plans}
        todo = [p for p in plans if existing[p.layout] is None]
        made: list[Variant] = []
        layouts = {p.layout for p in plans} | set(target.variants)
        orphans = [p.layout for p in todo if p.layout.component == "draft"
                   and dataclasses.replace(p.layout, component="main") not in layouts]
        if orphans:
            raise PlanError(f"the draft ({orphans[0]}) shares the main component's embedding and lm_head: load the main "
                            "component in the same dtype, scheme and rank first, or in the same request")
        todo.sort(key=lambda p: p.layout.component != "main")  # a draft's main variant exists before it
        try:
            with self._lock:
                self._make_room(model, sum(p.total_bytes for p in todo), target)
                if created:
                    model.versions[number] = target
                    model.last = max(model.last, number)
                target.loading += 1
            self._on_change()
            filler = Filler(self.device, self.backend, self.load_timeout_s, on_progress)
            if fill_all is not None:
                made = filler.stream(target, todo, fill_all, tensors_total, bytes_total)
            else:
                for plan in todo:
                    made.append(filler.one(target, plan, execute_one))
                    with self._lock:  # shown at once; of a version that exists, attachable too
                        target.variants[plan.layout] = made[-1]
        except BaseException:
            with self._lock:
                target.loading -= 1
                for variant in made:
                    target.variants.pop(variant.layout, None)
                    self.leases.evicted(variant)  # its slab goes: a lease on it must not stand
                if created:
                    model.versions.pop(number, None)
            for variant in made:
                free_slab(variant.slab)
            self._on_change()
            raise
        with self._lock:
            target.loading, target.creating = target.loading - 1, False
            for variant in made:
                target.variants[variant.layout] = variant
            activated = created and (activate or model.active not in model.versions)
            if activated:
                model.active = number
        if created:  # as SetActive would: the version it replaced may fall out of retention, or
            self._retain(model, protect=target)  # an older one, where a publish does not activate
        self._on_change()
        if created:
            log.info("%s v%d on %s from %s: %d variant(s)%s", model.name, number, self.device, target.source,
                     len(made), " (active)" if model.active == number else "")
        return [target.variants[p.layout] for p in plans]

    # -- attaching ----------------------------------------------------------------------------------

    def attach(self, name: str, session: Session, version: int = 0, layout: Layout | None = None,
               files: tuple[FileIdentity, ...] = ()) -> tuple[Variant, Lease]:
        """Leases the variant a caller wants: of `version` if given, else of the version loaded from
        `files` (the caller's checkpoint as it sees it), else of the active version; with `layout`
        (dtype "auto" resolved against that version), else the version's first main variant. A
        mismatch is an error naming what differs and what there is."""
        target = pick_version(self._model(name), version, files, self.device, self._lock, self._on_change)
        with self._lock:
            if target.creating:
                raise LoadingError(f"{name} v{target.number} is still loading on {self.device}; retry shortly "
                                   "(`preload wait-ready --model NAME --version V` waits for it)")
            if target.model.versions.get(target.number) is not target:
                raise NotFoundError(f"{name} v{target.number} was freed on {self.device} while attaching; attach again")
            variant = pick_variant(target, layout, self.device)
            check_slab_files(variant, self.device)
            lease = self.leases.grant(variant, session)
        log.info("lease %s: pid %d attached %s v%d (%s) on %s", lease.id, session.pid, name, target.number,
                 variant.layout, self.device)
        return variant, lease

    def verify(self, name: str = "", number: int = 0) -> list[tuple[Variant, str]]:
        """Re-hashes the slabs of `name` (every model if empty), version `number` (every version if
        0): (variant, the digest its bytes have now). A mismatch means the slab was written after
        it was sealed, which only this uid (or root) can do."""
        with self._lock:
            models = [self._model(name)] if name else list(self._models.values())
            variants = [var for m in models for v in ([find_version(m, number, self.device)] if number else m.versions.values())
                        for var in v.variants.values()]
        checks = [(variant, rehash(variant.slab)) for variant in variants]
        with self._lock:
            live = {id(variant) for variant in self.variants()}  # one evicted meanwhile is freed, not corrupt
            checks = [(variant, actual) for variant, actual in checks if actual and id(variant) in live]
            damaged = [(variant, actual) for variant, actual in checks if actual != variant.slab.digest]
            for variant, actual in damaged:
                variant.damaged = actual.removeprefix("gone: ") if actual.startswith("gone:") else \
                    f"its bytes changed after it was sealed: digest {actual}, sealed as {variant.slab.digest}"
        if damaged:
            self._notify()
        return checks

    # -- versions -----------------------------------------------------------------------------------

    def set_active(self, name: str, number: int) -> Model:
        """Moves the active pointer (publish's last step, rollback)."""
        model = self._model(name)
        with self._lock:
            version = find_version(model, number, self.device)
            if version.creating:
                raise LoadingError(f"{name} v{number} is still loading on {self.device}; activate it once loaded")
            if damaged := next((v.damaged for v in version.variants.values() if v.damaged), ""):
                raise StaleError(f"{name} v{number} on {self.device} is damaged ({damaged}) and handed out no more, "
                                 f"so it is not made active: `preload evict {name}@{number} --force`, then load it "
                                 "again")
            previous, model.active = model.active, number
            self._save_or_undo(lambda: setattr(model, "active", previous), f"{name}'s active version stays v{previous}")
        log.info("%s: active version v%d -> v%d on %s", name, previous, number, self.device)
        self._notify()
        self._retain(model)
        return model

    def pin(self, name: str, number: int, pinned: bool) -> Model:
        model = self._model(name)
        with self._lock:
            version = find_version(model, number, self.device)
            before, version.pinned = version.pinned, pinned
            self._save_or_undo(lambda: setattr(version, "pinned", before), f"{name} v{number} stays as it was")
        log.info("%s v%d %s on %s", name, number, "pinned" if pinned else "unpinned", self.device)
        self._notify()
        if not pinned:
            self._retain(model)
        return model

    def _write_state(self) -> None:  # caller holds the lock
        adopt.write_state(self.shm_dir, self.device, [m for m in self._models.values() if m.versions or m.last])

    def _save_or_undo(self, undo, kept: str) -> None:
        """Saves the pointers after a change a user asked for, or undoes it and says why (a rollback
        /dev/shm had no room to record reported success, and a restart after a crash undid it)."""
        try:
            self._write_state()
        except OSError as e:
            undo()
            raise DeviceError(f"cannot save the model pointers in {self.shm_dir} ({e.strerror or e}), which a daemon "
                              f"restarted after a crash reads; {kept}: free space there (`df {self.shm_dir}`), then "
                              "try again") from None

    def evict(self, name: str, version: int = 0, force: bool = False) -> list[Variant]:
        """Removes one version (or all, version=0). Leased or pinned versions need force; mapped
        pages stay valid in the processes that hold them."""
        model = self._model(name)
        with self._lock:
            victims = [find_version(model, version, self.device)] if version else list(model.versions.values())
            loading = [v for v in victims if v.loading]
            if loading:
                raise LoadingError(f"{name} v{loading[0].number} is loading on {self.device}; evict it once loaded")
            leased = [v for v in victims if v.num_leases]
            pinned = [v for v in victims if v.pinned]
            if leased and not force:
                holders = sorted({lease.pid for v in leased for var in v.variants.values() for lease in var.leases.values()})
                raise LeasedError(f"{name} is leased by pid {', '.join(map(str, holders))} on {self.device}; "
                                  "stop those workers first, or pass --force (their mappings stay valid)")
            if pinned and not force:
                raise LeasedError(f"{name} v{', v'.join(str(v.number) for v in pinned)} is pinned on {self.device}; "
                                  f"`preload unpin {name}@{pinned[0].number}` first, or pass --force")
            freed = self._drop(model, victims)
        self._on_change()
        return freed

    def _drop(self, model: Model, victims: list[Version]) -> list[Variant]:
        """Forgets `victims` and frees their slabs (caller holds the lock)."""
        freed = []
        for version in victims:
            model.versions.pop(version.number, None)
            for variant in version.variants.values():
                self.leases.evicted(variant)
                free_slab(variant.slab)
                freed.append(variant)
            log.info("freed %s v%d on %s (%d variant(s), %.1f MiB)", model.name, version.number, self.device,
                     len(version.variants), version.bytes / 2**20)
        if model.active not in model.versions:
            ready = [n for n, v in model.versions.items() if not v.loading]
            model.active = max(ready, default=0)
        if not model.versions and not model.load_lock.locked() and not model.last:
            self._models.pop(model.name, None)  # (a record that gave out numbers stays: they are never reused)
        return freed

    def _retain(self, model: Model, protect: Version | None = None) -> None:
        """Frees the versions beyond the newest `keep` evictable ones (but `protect`, just made)."""
        with self._lock:
            victims = evictable(model, protect)[model.keep:]
            if victims:
                log.info("retention (keep %d) frees %s v%s on %s", model.keep, model.name,
                         ", v".join(str(v.number) for v in victims), self.device)
                self._drop(model, victims)
        if victims:
            self._on_change()

    def _make_room(self, model: Model, needed: int, target: Version) -> None:
        """Within the byte budget, frees the oldest evictable versions until `needed` more bytes fit,
        or refuses (caller holds the lock)."""
        victims = budget_victims(model, needed, target)
        if victims:
            log.info("budget of %s frees v%s on %s", model.name, ", v".join(str(v.number) for v in victims),
                     self.device)
            self._drop(model, victims)

    # -- reading the store --------------------------------------------------------------------------

    def _model(self, name: str, create: bool = False) -> Model:
        with self._lock:
            return find_model(self._models, name, self.device, create)

    def variants(self) -> list[Variant]:
        """Every variant of every version, by model, version and load order."""
        with self._lock:
            return [var for _, m in sorted(self._models.items()) for _, v in sorted(m.versions.items())
                    for var in v.variants.values()]

    def models(self) -> list[Model]:
        with self._lock:
            return [m for _, m in sorted(self._models.items())]

    def usage(self) -> list[tuple[str, int, int, int]]:
        """(model, version, bytes, leases) of every version, read under the lock (for metrics)."""
        with self._lock:
            return [(m.name, n, v.bytes, v.num_leases) for m in self._models.values()
                    for n, v in sorted(m.versions.items())]

    def is_loading(self) -> bool:
        with self._lock:
            return self._loads.count > 0

    def close(self) -> None:
        """Frees every slab (graceful daemon shutdown)."""
        with self._lock:
            for variant in self.variants():
                free_slab(variant.slab)
            self._models.clear()
            self.leases.clear()
            adopt.state_path(self.shm_dir, self.device).unlink(missing_ok=True)
