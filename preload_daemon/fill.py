"""Making the slabs of one load or publish: a new slab per variant (from the daemon's backend,
slab.py), filled from its load plan (a directory) or from a stream, hashed, sealed and, where it can
outlive the daemon, recorded for a daemon that may adopt it (adopt.py), with progress and a
deadline. The store decides what to make and installs what this returns (store.py)."""

import dataclasses
import logging
import time

from preload_daemon import adopt
from preload_daemon.errors import DeviceError, LoadingError
from preload_daemon.plan import LoadPlan
from preload_daemon.records import LoadProgress, Variant, Version, key_for
from preload_daemon.slab import DIGEST_ALGORITHM, Slab, new_hasher

log = logging.getLogger(__name__)
# A load reports its progress at most this often (a report is a message for every client
# watching: one per tensor made the load of 20,000 small tensors take 273-313 ms against 205-221).
PROGRESS_EVERY_S = 0.02


class Filler:
    def __init__(self, device: str, backend, timeout_s: float, on_progress):
        self.device, self.backend, self.timeout_s, self.on_progress = device, backend, timeout_s, on_progress
        self.deadline = time.monotonic() + timeout_s

    def one(self, version: Version, plan: LoadPlan, execute_one) -> Variant:
        """A variant from a directory: `execute_one(plan, slab, on_tensor, hasher)` fills it in plan order."""
        start = time.monotonic()
        slab = self._new_slab(version, plan)
        on_tensor = self._progress(version, plan.tensor_bytes, len(plan.entries))
        hasher = new_hasher()
        try:
            execute_one(plan, slab, on_tensor, hasher)
            slab.seal(f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}")
            return self._variant(version, plan, slab, time.monotonic() - start)
        except BaseException:
            free_slab(slab)
            raise

    def stream(self, version: Version, plans: list[LoadPlan], fill_all, tensors_total: int,
               bytes_total: int) -> list[Variant]:
        """Every plan's variant at once from one stream: `fill_all([(plan, slab)], on_tensor)`."""
        start = time.monotonic()
        slabs: list[Slab] = []
        try:
            for plan in plans:
                slabs.append(self._new_slab(version, plan))
            for slab in slabs:  # a stream writes anywhere in them: wholly backed first
                slab.allocated(slab.size)
            fill_all(list(zip(plans, slabs)), self._progress(version, bytes_total, tensors_total))
            for slab in slabs:
                slab.seal(slab.hash())  # written out of plan order: hashed once, whole
            seconds = time.monotonic() - start
            made: list[Variant] = []
            for plan, slab in zip(plans, slabs):
                made.append(self._variant(version, plan, slab, seconds, tuple(made)))
            return made
        except BaseException:
            for slab in slabs:
                free_slab(slab)
            raise

    def _progress(self, version: Version, bytes_total: int, tensors_total: int):
        """The per-tensor callback: progress (reported at most every PROGRESS_EVERY_S, and at the
        last tensor), and the deadline."""
        progress = LoadProgress("reading", 0, bytes_total, 0, tensors_total)
        self.on_progress(progress)
        next_report = time.monotonic() + PROGRESS_EVERY_S

        def on_tensor(item) -> None:
            nonlocal next_report
            now = time.monotonic()
            if now > self.deadline:
                raise LoadingError(f"loading {version.model.name} v{version.number} on {self.device} took longer "
                                   f"than {self.timeout_s:g}s (the daemon's --load-timeout); nothing of it was kept. "
                                   "Raise --load-timeout for very large checkpoints or slow disks")
            progress.bytes_done += item.nbytes
            progress.tensors_done += 1
            if now >= next_report or progress.tensors_done == tensors_total:
                next_report = now + PROGRESS_EVERY_S
                self.on_progress(progress)
        return on_tensor

    def _new_slab(self, version: Version, plan: LoadPlan) -> Slab:
        layout = plan.layout
        label = f"{adopt.device_tag(self.device)}-{version.model.name}-v{version.number}-r{layout.tp_rank}-" \
                f"{layout.component}-{layout.dtype}-{layout.quantization}"
        return self.backend.create(label, plan.total_bytes)

    def _variant(self, version: Version, plan: LoadPlan, slab: Slab, seconds: float,
                 made: tuple[Variant, ...] = ()) -> Variant:
        """The variant of a sealed slab, recorded for adoption where it can outlive the daemon."""
        digest = slab.digest
        log.info("loaded %s v%d on %s (%s): %d tensors, %.1f MiB in %.2fs (%.2f GB/s)", version.model.name,
                 version.number, self.device, plan.layout, len(plan.entries), plan.total_bytes / 2**20, seconds,
                 plan.tensor_bytes / max(seconds, 1e-9) / 1e9)
        variant = Variant(version, plan.layout, plan, key_for(version.files, plan, digest), slab, time.time(), seconds)
        if plan.layout.component == "draft":
            main = dataclasses.replace(plan.layout, component="main")
            variant.base = version.variants.get(main) or next(v for v in made if v.layout == main)
        if slab.adoptable:  # without its record, a daemon restarted after a crash would delete the slab
            try:
                adopt.write_record(variant)
            except OSError as e:  # (a full /dev/shm): the load fails, as a rollback that cannot be saved does
                raise DeviceError(f"cannot record the slab of {version.model.name} v{version.number} on {self.device} "
                                  f"beside it ({e.strerror or e}), which a daemon restarted after a crash needs to "
                                  f"keep it; nothing of this load was kept: free space in {slab.path.parent} "
                                  f"(`df {slab.path.parent}`), then load it again") from None
        return variant


def free_slab(slab: Slab) -> None:
    """Unmaps and deletes a slab (and its record). Processes that mapped it keep their pages."""
    slab.close()
    slab.unlink()
