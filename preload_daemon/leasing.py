"""The store's lease book: which leases stand, on which variant, and how they end (released, with
their session, reaped by pid, or evicted with their version). It shares the store's lock; ending a
lease hands its model back to the store's retention, which may then free what no lease holds."""

import collections
import logging
import time
from collections.abc import Callable

from preload_daemon.errors import AccessDeniedError, InvalidRequestError, NotFoundError
from preload_daemon.leases import Lease, holder_alive
from preload_daemon.records import Model, Variant
from preload_daemon.sessions import Session

log = logging.getLogger(__name__)

MAX_LEASES_PER_SESSION = 1024
"""An engine holds a lease per variant it maps (two with a draft, four while it switches versions);
without a bound one process could take millions, each listed by every ListModels."""


class Leases:
    """The leases of one store, by id, each with the variant it pins."""

    def __init__(self, lock, on_release: Callable[[Model], None]):
        self._lock = lock
        self._on_release = on_release
        self._variants: dict[str, Variant] = {}
        self._ended_sessions: collections.deque = collections.deque()
        self._ended_set: set[str] = set()
        """Sessions that closed recently (the last 4096; the set for lookups): an Attach racing its
        session's close is refused."""
        self._per_session: collections.Counter = collections.Counter()
        """Standing leases by session token."""
        self.ended: collections.Counter = collections.Counter()
        """By how: released, session (its process exited), reaped, evicted."""

    def grant(self, variant: Variant, session: Session) -> Lease:
        """A new lease on `variant` for the session's process (caller holds the lock)."""
        if session.token in self._ended_set:
            raise NotFoundError(f"the session of pid {session.pid} closed while attaching; attach again")
        if self._per_session[session.token] >= MAX_LEASES_PER_SESSION:
            raise InvalidRequestError(f"pid {session.pid} holds {MAX_LEASES_PER_SESSION} leases on this daemon, the "
                                      "most one session may; release those it no longer maps before attaching again")
        version = variant.version
        lease = Lease.new(session.pid, session.pid_start_time, version.model.name, version.number, session.token)
        variant.leases[lease.id] = lease
        self._variants[lease.id] = variant
        self._per_session[session.token] += 1
        return lease

    def _forget(self, lease: Lease) -> None:
        """Drops a lease from the per-session count (caller holds the lock)."""
        self._per_session[lease.session] -= 1
        if self._per_session[lease.session] <= 0:
            del self._per_session[lease.session]

    def renew(self, lease_id: str, session: str | None = None) -> Lease:
        """`session`: the token of the session asking (an RPC's), which must be the lease's."""
        with self._lock:
            variant = self._variants.get(lease_id)
            if variant is None:
                raise NotFoundError(f"lease {lease_id} is unknown or was reaped; attach again")
            lease = variant.leases[lease_id]
            _check_holder(lease, session, "renewed")
            lease.renewed_at = time.time()
            return lease

    def release(self, lease_id: str, why: str = "released", how: str = "released", session: str | None = None) -> None:
        """`session` as renew's (the daemon's own ends, of a session or a process gone, give none)."""
        with self._lock:
            variant = self._variants.get(lease_id)
            if variant is None:
                raise NotFoundError(f"lease {lease_id} is unknown or was already released")
            _check_holder(variant.leases[lease_id], session, "released")
            del self._variants[lease_id]
            lease = variant.leases.pop(lease_id)
            self._forget(lease)
            self.ended[how] += 1
        log.info("lease %s of pid %d on %s v%d %s", lease_id, lease.pid, lease.model, lease.version, why)
        self._on_release(variant.version.model)

    def end_session(self, session: Session) -> None:
        """A session's connection closed (its process exited, or let go): its leases end now."""
        with self._lock:
            self._ended_sessions.append(session.token)
            self._ended_set.add(session.token)
            if len(self._ended_sessions) > 4096:
                self._ended_set.discard(self._ended_sessions.popleft())
            ids = [i for i, v in self._variants.items() if v.leases[i].session == session.token]
        for lease_id in ids:
            try:
                self.release(lease_id, "ended with its session (the process exited or closed its client)", "session")
            except NotFoundError:
                continue

    def reap(self) -> list[Lease]:
        """Drops the leases of processes that are gone; returns them. Each process is looked up once,
        however many leases it holds."""
        with self._lock:
            leases = [v.leases[i] for i, v in self._variants.items()]
        alive = {holder: holder_alive(*holder) for holder in {(lease.pid, lease.pid_start_time) for lease in leases}}
        dead = [lease for lease in leases if not alive[lease.pid, lease.pid_start_time]]
        for lease in dead:
            try:
                self.release(lease.id, "reaped: its process is gone", "reaped")
            except NotFoundError:
                continue
        return dead

    def evicted(self, variant: Variant) -> None:
        """The variant's slab is being freed with its leases standing (caller holds the lock)."""
        for lease_id, lease in variant.leases.items():
            if self._variants.pop(lease_id, None) is not None:
                self._forget(lease)
                self.ended["evicted"] += 1

    def clear(self) -> None:
        """Forgets every lease: the store is freeing every slab (caller holds the lock)."""
        self._variants.clear()
        self._per_session.clear()


def _check_holder(lease: Lease, session: str | None, done: str) -> None:
    """A lease is renewed or released only by the session that took it (its id is public: ListModels
    shows it): another process releasing it would let its version be evicted under its engine."""
    if session is not None and session != lease.session:
        raise AccessDeniedError(f"lease {lease.id} is held by another session (pid {lease.pid}) and is {done} only by "
                                "it; it ends with that process. To free its version anyway: `preload evict "
                                f"{lease.model}@{lease.version} --force`")
