"""The gRPC server: a thin servicer over the ModelStore (wire.py converts its messages), the
standard health and reflection services, and the session socket that ties leases to processes.
PreloadErrors become gRPC statuses here, in one place.

gRPC serves its Unix socket directly. Only this uid (and root) can reach it: the runtime directory
is 0700 and the socket 0600, so the kernel refuses strangers before any byte is read. Callers are
identified where it matters, for leases, through their session (sessions.py)."""

import fcntl
import functools
import logging
import os
import queue
import threading
import time
from concurrent import futures

import grpc
import psutil
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from preload_daemon import __version__
from preload_daemon import stream, wire
from preload_daemon.cachekey import file_identity
from preload_daemon.config import DaemonConfig
from preload_daemon.errors import InvalidRequestError, LoadingError, NotFoundError, PreloadError, to_status
from preload_daemon.metrics import DaemonMetrics
from preload_daemon.matching import mark_stale
from preload_daemon.records import check_name
from preload_daemon.runtime_dir import ensure_private_dir, lock_path
from preload_daemon.sessions import ATTACH, Session, SessionServer, session_path
from preload_daemon.store import ModelStore
from preload_daemon.wire import MAX_LEASE_ID
from protos import preload_pb2 as pb
from protos import preload_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["WeightCache"].full_name
MAX_FILES = 100_000
MAX_LOADS = 8  # of the server's 16 RPC threads


def _rpc(method):
    """Maps PreloadError to its status code; anything else is an internal error, logged. Counts
    errors by kind."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except PreloadError as e:
            self.metrics.errors.labels(type(e).__name__).inc()
            context.abort(*to_status(e))
        except Exception:
            self.metrics.errors.labels("internal").inc()
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}; see the daemon log")
    return wrapper


class WeightCacheServicer(pb_grpc.WeightCacheServicer):
    def __init__(self, store: ModelStore, sessions: SessionServer, started_at: float, config: DaemonConfig,
                 metrics: DaemonMetrics):
        self.store = store
        self.sessions = sessions
        self.metrics = metrics
        self.started_at = started_at
        self.config = config
        # Loads and publishes hold an RPC thread each (a queued load waits for the one before it):
        # bounded, so attaches, leases and status always have threads left.
        self.loads = threading.BoundedSemaphore(MAX_LOADS)

    def LoadModel(self, request, context):
        try:
            spec = wire.spec_from_proto(request.spec)
            layouts = wire.layouts(request.layouts)
            retention = wire.retention(request.retention)
        except PreloadError as e:
            context.abort(*to_status(e))
        self._take_load_slot(context)
        started = time.monotonic()
        updates: queue.Queue = queue.Queue()
        result: dict = {}

        def run() -> None:
            try:
                result["variants"] = self.store.load(spec, layouts, request.version, request.activate, retention,
                                                     lambda p: updates.put(wire.progress(p)))
            except BaseException as e:  # handed to the streaming thread below
                result["error"] = e
            finally:
                self.loads.release()
                updates.put(None)

        # The load runs on its own thread: a client that disconnects does not cancel it.
        threading.Thread(target=run, name=f"load-{spec.name}", daemon=True).start()
        while (update := updates.get()) is not None:
            if update.stage != "reading" or update.tensors_done in (0, update.tensors_total) \
                    or updates.qsize() == 0:  # coalesce when the client reads slower than we load
                yield update
        if "error" in result:
            self._abort(context, f"loading {spec.name}", result["error"])
        self._count_load(started)
        variants = [wire.info(v) for v in result["variants"]]
        total = sum(v.plan.tensor_bytes for v in result["variants"])
        tensors = sum(len(v.plan.entries) for v in result["variants"])
        yield pb.LoadProgress(stage="ready", bytes_done=total, bytes_total=total, tensors_done=tensors,
                              tensors_total=tensors, model=variants[0], variants=variants)

    def PublishStream(self, request_iterator, context):
        # The slot first: a header (up to the 64 MiB a message may be) is read and parsed only by the
        # MAX_LOADS calls that hold one (parsed before, 8 publishes' headers of 58 MiB took 1.4 GB).
        self._take_load_slot(context)
        try:
            try:
                first = wire.first_chunk(request_iterator, self.config.publish_stall_s)
                if first is None or first.WhichOneof("kind") != "header":
                    raise InvalidRequestError("PublishStream must start with a header (model, config_json, tensors)")
                header = first.header
                table = stream.StreamedCheckpoint(header)
                layouts = wire.layouts(header.layouts)
                retention = wire.retention(header.retention)
                model, version, activate = header.model, header.version, header.activate
            except PreloadError as e:
                context.abort(*to_status(e))
            del first, header  # the header's message is not kept while the stream runs
            started = time.monotonic()
            try:
                variants = self.store.publish_stream(table, model, wire.chunks(request_iterator, context,
                                                                               self.config.publish_stall_s),
                                                     version, layouts, activate, retention)
                self._count_load(started)
                return pb.PublishResponse(variants=[wire.info(v) for v in variants])
            except Exception as e:
                self._abort(context, f"publishing {model}", e)
        finally:
            self.loads.release()

    @_rpc
    def SetActive(self, request, context):
        return wire.summary(self.store.set_active(request.model, request.version))

    @_rpc
    def Pin(self, request, context):
        return wire.summary(self.store.pin(request.model, request.version, request.pinned))

    @_rpc
    def ListModels(self, request, context):
        with self.store.lock:  # a consistent view, while loads and releases change the store
            return pb.ListModelsResponse(models=[wire.info(v) for v in self.store.variants()],
                                         summaries=[wire.summary(m) for m in self.store.models()])

    @_rpc
    def Attach(self, request, context):
        args = _attach_args(request)
        session = self.sessions.get(request.session) if len(request.session) <= MAX_LEASE_ID else None
        if session is None:
            raise NotFoundError("Attach needs the token of an open session: connect to the daemon's session socket "
                                f"({self.sessions.path.name}) and keep it open (DaemonClient.attach does this)")
        return pb.AttachResponse.FromString(self._attach(request, session, *args))

    def session_request(self, session: Session, kind: int, payload: bytes) -> bytes:
        """A request on a session (sessions.py): ATTACH, an AttachRequest whose lease is the session's."""
        if kind != ATTACH:
            raise InvalidRequestError(f"unknown session request kind {kind}; this daemon answers Attach ({ATTACH})")
        try:
            request = pb.AttachRequest.FromString(payload)
        except DecodeError:
            raise InvalidRequestError("a session Attach request is not an AttachRequest message") from None
        try:
            return self._attach(request, session, *_attach_args(request))
        except PreloadError as e:
            self.metrics.errors.labels(type(e).__name__).inc()
            raise

    def _attach(self, request: pb.AttachRequest, session: Session, layout, files) -> bytes:
        """The serialized AttachResponse: the variant's manifest (serialized once per variant) and
        a new lease bound to `session`."""
        started = time.monotonic()
        variant, lease = self.store.attach(request.model, session, request.version, layout, files)
        response = wire.attach_response(variant, lease)
        self.metrics.attaches.inc()
        self.metrics.attach_seconds.observe(time.monotonic() - started)
        return response

    @_rpc
    def RenewLease(self, request, context):
        lease = self.store.leases.renew(wire.lease_id(request.lease_id), request.session)
        return pb.RenewLeaseResponse(lease=wire.lease(lease))

    @_rpc
    def Release(self, request, context):
        self.store.leases.release(wire.lease_id(request.lease_id), session=request.session)
        return pb.ReleaseResponse()

    @_rpc
    def Evict(self, request, context):
        victims = self.store.evict(request.model, request.version, request.force)
        return pb.EvictResponse(evicted=[wire.info(v, False) for v in victims])

    @_rpc
    def GetStats(self, request, context):
        with self.store.lock:
            for model in self.store.models():  # status and wait-ready show what an engine attaching by files finds
                for version in model.versions.values():
                    if not version.loading:
                        mark_stale(version)
            return self._stats()

    def _stats(self) -> pb.Stats:
        variants = self.store.variants()
        return pb.Stats(device=self.store.device, pid=os.getpid(), started_at=self.started_at,
                        resident_bytes=sum(v.slab.size for v in variants),
                        num_leases=sum(len(v.leases) for v in variants),
                        models=[wire.info(v) for v in variants],
                        summaries=[wire.summary(m) for m in self.store.models()],
                        serving=bool(variants) and not self.store.is_loading(),
                        runtime_dir=str(self.config.runtime_dir), version=__version__,
                        num_sessions=len(self.sessions), recovery=self.store.recovery,
                        adoption_seconds=self.store.adoption_seconds, adopted_bytes=self.store.adopted_bytes)

    @_rpc
    def Verify(self, request, context):
        started = time.monotonic()
        checks = self.store.verify(request.model, request.version)
        slabs = [pb.SlabCheck(model=v.name, version=v.version.number, layout=wire.layout_proto(v.layout),
                              slab=v.slab.id, expected=v.slab.digest, actual=actual, ok=actual == v.slab.digest)
                 for v, actual in checks]
        for check in slabs:
            if check.actual.startswith("gone:"):
                log.error("the file of slab %s of %s v%d is %s", check.slab, check.model, check.version,
                          check.actual.removeprefix("gone: file "))
            elif not check.ok:
                log.error("slab %s of %s v%d was changed after it was sealed: digest %s, sealed as %s", check.slab,
                          check.model, check.version, check.actual, check.expected)
        return pb.VerifyResponse(slabs=slabs, seconds=time.monotonic() - started)

    def _take_load_slot(self, context) -> None:
        """One of the MAX_LOADS slots for a load or publish, or the call is refused (never queued)."""
        if not self.loads.acquire(blocking=False):
            context.abort(*to_status(LoadingError(f"{MAX_LOADS} loads and publishes are in flight on this daemon; "
                                                  "retry when one finishes")))

    def _count_load(self, started: float) -> None:
        self.metrics.loads.labels("ok").inc()
        self.metrics.load_seconds.observe(time.monotonic() - started)

    def _abort(self, context, what: str, error: BaseException) -> None:
        self.metrics.loads.labels("failed").inc()
        self.metrics.errors.labels(type(error).__name__ if isinstance(error, PreloadError) else "internal").inc()
        if isinstance(error, PreloadError):  # in the log too (a failed load was only in `preload status`)
            log.warning("%s failed, nothing of it was kept: %s", what, error)
            context.abort(*to_status(error))
        log.error("%s failed", what, exc_info=error)
        context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {error}; see the daemon log")


def _attach_args(request: pb.AttachRequest) -> tuple:
    """An AttachRequest's layout and file identities, checked."""
    layout = wire.layout(request.layout) if request.HasField("layout") else None
    if len(request.files) > MAX_FILES:
        raise InvalidRequestError(f"{len(request.files)} checkpoint files is more than {MAX_FILES}")
    files = tuple(file_identity(f) for f in request.files)
    check_name(request.model)
    return layout, files


class DaemonServer:
    """The running server: gRPC on the daemon's socket, sessions on the one beside it."""

    def __init__(self, config: DaemonConfig):
        self.config = config
        ensure_private_dir(config.runtime_dir)
        self._lock_fd = _lock_device(config)
        self.sessions = None
        try:
            self.serving_since = 0.0
            self.health = health.HealthServicer()
            self.store = ModelStore(config.device, config.shm_dir, on_change=self.update_health,
                                    allow_external=config.allow_external_links, load_timeout_s=config.load_timeout_s)
            self.store.adopt()
            self.sessions = SessionServer(session_path(config.socket_path), self.store.leases.end_session,
                                          config.max_sessions,
                                          on_request=lambda *request: self.servicer.session_request(*request))
            options = [("grpc.max_receive_message_length", config.max_message_bytes),
                       ("grpc.max_send_message_length", config.max_message_bytes)]
            # RPCs past the cap are refused by gRPC with RESOURCE_EXHAUSTED; idle connections cost no thread.
            self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rpc"),
                                      options=options, maximum_concurrent_rpcs=config.max_rpcs)
            self.metrics = DaemonMetrics(self, psutil.Process().create_time())
            self.servicer = WeightCacheServicer(self.store, self.sessions, time.time(), config, self.metrics)
            pb_grpc.add_WeightCacheServicer_to_server(self.servicer, self.server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
            config.socket_path.unlink(missing_ok=True)
            old_umask = os.umask(0o177)  # the socket is born 0600
            try:
                self.server.add_insecure_port(f"unix:{config.socket_path}")
            finally:
                os.umask(old_umask)
            os.chmod(config.socket_path, 0o600)
        except BaseException:
            if getattr(self, "sessions", None) is not None:
                self.sessions.close()  # its listening socket, file and threads
            if getattr(self, "store", None) is not None and not self.store.models():
                # adopt() wrote this device's state file: with nothing to keep (no slab adopted, no
                # number to remember) it goes, and then the slab directory if empty (both had stayed)
                self.store.close()
            os.close(self._lock_fd)  # a retry in this process must not find the device locked
            self._remove_shm_dir_if_empty()  # a refused start (a cuda daemon without a GPU) had left it
            raise
        self.update_health()

    @property
    def address(self) -> str:
        return f"unix:{self.config.socket_path}"

    def start(self) -> None:
        self.server.start()
        self.sessions.start()

    def ready(self) -> bool:
        """Serving: at least one model loaded that is handed out (not damaged), and no load in flight."""
        return any(not v.damaged for v in self.store.variants()) and not self.store.is_loading()

    def update_health(self) -> None:
        ready = self.ready()
        if ready and not self.serving_since:
            self.serving_since = time.time()
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE, status)

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace).wait()
        self.sessions.close()
        self.config.socket_path.unlink(missing_ok=True)
        self.store.close()
        os.close(self._lock_fd)
        self._remove_shm_dir_if_empty()

    def _remove_shm_dir_if_empty(self) -> None:
        """The slab directory is shared with this runtime dir's other daemons: removed only if empty
        (the next daemon makes a new one)."""
        try:
            self.config.shm_dir.rmdir()
        except OSError:
            pass


def _lock_device(config: DaemonConfig) -> int:
    """One daemon per device and runtime dir: an exclusive lock the kernel drops when the daemon
    dies, so a new daemon knows the slabs it finds have no live owner."""
    fd = os.open(lock_path(config.runtime_dir, config.device), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InvalidRequestError(f"a daemon for {config.device} already runs in {config.runtime_dir}; use it "
                                  "(`preload status`) or stop it before starting another") from None
    return fd


def create_server(config: DaemonConfig) -> tuple[DaemonServer, str]:
    """A started server and its address (for tests and embedding)."""
    server = DaemonServer(config)
    server.start()
    return server, server.address
