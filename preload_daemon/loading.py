"""Loads of a model, one at a time: a load or publish holds its model's load lock, is counted while
it runs (a daemon with a load in flight does not report serving), and, if it fails, leaves a record
of the failure and undoes the retention it set."""

from collections.abc import Callable

from preload_daemon.errors import LoadingError, VersionTakenError
from preload_daemon.records import MAX_VERSION, LoadProgress, Model, Retention, Version

MAX_IDLE_RECORDS = 256


class Loads:
    """The loads in flight in one store, which shares its lock and its table of models."""

    def __init__(self, device: str, lock, models: dict[str, Model], on_change: Callable[[], None]):
        self.device = device
        self.lock = lock
        self.models = models
        self.on_change = on_change
        self.count = 0
        """Loads and publishes running now (read and written under `lock`)."""


class Loading:
    """One load of a model at a time. A failed one is remembered (`preload status`, wait-ready)
    under the version number it asked for (publish asks for one), which is then never given to
    another version, or the one it made and freed; the retention it set is undone. One refused
    because its number was taken (VersionTakenError) failed no load and is not remembered."""

    def __init__(self, loads: Loads, model: Model, number: int, on_progress, wait: bool = True):
        self.loads, self.model, self.on_progress, self.wait = loads, model, on_progress, wait
        self.requested = number
        self.number: int | Version = number
        self.retention = (model.keep, model.max_bytes)

    def __enter__(self) -> "Loading":
        """Holds the load lock of the model the store has under this name: `self.model` from then
        on, which the caller must use (not the one it passed)."""
        queued = False
        while True:
            if not self.model.load_lock.acquire(blocking=False):
                if not self.wait:
                    raise LoadingError(f"{self.model.name} is being loaded or published on {self.loads.device}; "
                                       "publish again once that finishes (`preload status`)")
                if not queued:
                    self.on_progress(LoadProgress("queued"))
                    queued = True
                self.model.load_lock.acquire()
            with self.loads.lock:
                # An eviction while this load waited may have dropped the model (back it goes), and
                # a load since may have made a new one of that name: this load then queues on that
                # one, or it would fill a model the store no longer holds (a slab nothing frees,
                # whose record a restarted daemon would adopt).
                current = self.loads.models.setdefault(self.model.name, self.model)
                if current is self.model:
                    self.loads.count += 1
                    self.retention = (self.model.keep, self.model.max_bytes)
                    break
            self.model.load_lock.release()
            self.model = current
        self.loads.on_change()
        return self

    def set_retention(self, retention: Retention) -> None:
        """The model's retention from now on; undone if this load fails."""
        with self.loads.lock:
            if retention.keep is not None:
                self.model.keep = retention.keep
            if retention.max_bytes is not None:
                self.model.max_bytes = retention.max_bytes

    def __exit__(self, kind, error, tb) -> None:
        with self.loads.lock:
            self.loads.count -= 1
            if error is not None:
                self.model.keep, self.model.max_bytes = self.retention
            if error is not None and not isinstance(error, VersionTakenError):  # (a number taken: no load failed)
                if isinstance(self.number, Version):
                    what = f"{self.number.number} (a variant)"
                elif 0 < self.requested <= MAX_VERSION:
                    what = str(self.requested)  # a number asked for (publish): never given out later
                    if self.model.last or self.model.versions:  # (a name with none yet has none to keep apart)
                        self.model.last = max(self.model.last, self.requested)
                elif 0 < self.number <= self.model.last and self.number not in self.model.versions:
                    what = str(self.number)  # the next number, made and freed again: used up
                else:
                    what = "-"
                self.model.failures.appendleft(f"{what}: {kind.__name__}: {error}"[:500])
            self.model.load_lock.release()
            if not self.model.versions and not self.model.failures and self.loads.models.get(self.model.name) is self.model:
                self.loads.models.pop(self.model.name)
            # Records of names that failed without ever giving out a number stay for status and
            # wait-ready; the oldest beyond MAX_IDLE_RECORDS go, or a loop of failing loads under new
            # names would grow ListModels and status without end. A record that gave out numbers
            # stays (they are never reused).
            idle = [name for name, m in self.loads.models.items()
                    if not m.versions and not m.last and not m.load_lock.locked()]
            for name in idle[:max(0, len(idle) - MAX_IDLE_RECORDS)]:
                del self.loads.models[name]
        self.loads.on_change()
