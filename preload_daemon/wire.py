"""Conversions between the store's records and protobuf messages, with the checks of what a request
may hold, and the reader of a PublishStream's tensor data: what the servicer (server.py) sends and
receives, as plain functions."""

import os
import queue
import threading
import time

import grpc

from preload_daemon.errors import InvalidRequestError
from preload_daemon.plan import SHARED_ROLES, Layout, LoadSpec
from preload_daemon.records import LoadProgress, Model, Retention, Variant
from protos import preload_pb2 as pb

MAX_NAME = 4096
MAX_KEEP = 1000
MAX_LEASE_ID = 64
MAX_LAYOUTS = 64


def spec_from_proto(msg: pb.LoadSpec) -> LoadSpec:
    if not msg.path or len(msg.path) > MAX_NAME or "\0" in msg.path:
        raise InvalidRequestError("LoadModel needs spec.path, the checkpoint directory (at most "
                                  f"{MAX_NAME} characters, no NUL)")
    if not os.path.isabs(msg.path):  # the daemon's working directory is not the caller's
        raise InvalidRequestError(f"spec.path {msg.path[:200]!r} is relative; send the checkpoint directory's "
                                  "absolute path (DaemonClient.load and the CLI make it absolute)")
    return LoadSpec(path=os.path.normpath(msg.path), name=msg.name, dtype=msg.dtype or "auto",
                    quantization=msg.quantization or "none", tp_size=msg.tp_size or 1, tp_rank=msg.tp_rank,
                    component=msg.component or "main")


def lease_id(lease_id: str) -> str:
    if not lease_id or len(lease_id) > MAX_LEASE_ID:
        raise InvalidRequestError(f"a lease id is 1..{MAX_LEASE_ID} characters, got {len(lease_id)}")
    return lease_id


def layouts(msgs) -> tuple[Layout, ...]:
    """A request's layouts, at most MAX_LAYOUTS: each costs a load plan before anything is read (100,000
    empty ones took 24 s of a core and 400 MiB of the daemon's memory)."""
    if len(msgs) > MAX_LAYOUTS:
        raise InvalidRequestError(f"{len(msgs)} layouts in one request; at most {MAX_LAYOUTS} (a daemon holds one "
                                  "device's variants: a dtype and scheme per TP rank and component)")
    return tuple(dict.fromkeys(layout(x) for x in msgs))


def layout(msg: pb.Layout) -> Layout:
    return Layout(dtype=msg.dtype or "auto", quantization=msg.quantization or "none", tp_size=msg.tp_size or 1,
                  tp_rank=msg.tp_rank, component=msg.component or "main")


def layout_proto(layout: Layout) -> pb.Layout:
    return pb.Layout(dtype=layout.dtype, quantization=layout.quantization, tp_size=layout.tp_size,
                     tp_rank=layout.tp_rank, component=layout.component)


def retention(msg: pb.Retention) -> Retention:
    keep = msg.keep if msg.HasField("keep") else None
    if keep is not None and keep > MAX_KEEP:
        raise InvalidRequestError(f"keep {keep} is more than {MAX_KEEP} versions")
    return Retention(keep, msg.max_bytes if msg.HasField("max_bytes") else None)


def progress(p: LoadProgress) -> pb.LoadProgress:
    return pb.LoadProgress(stage=p.stage, bytes_done=p.bytes_done, bytes_total=p.bytes_total,
                           tensors_done=p.tensors_done, tensors_total=p.tensors_total)


def lease(lease) -> pb.Lease:
    return pb.Lease(id=lease.id, pid=lease.pid, pid_start_time=lease.pid_start_time, created_at=lease.created_at)


def manifest_bytes(variant: Variant) -> bytes:
    """The variant's serialized manifest (`_manifest`), built on its first attach and kept: tens of
    thousands of tensors take a Python loop once, and a variant never changes once sealed."""
    if variant.wire_manifest is None:
        variant.wire_manifest = _manifest(variant).SerializeToString()
    return variant.wire_manifest


def attach_response(variant: Variant, lease_record) -> bytes:
    """A serialized AttachResponse: the kept manifest bytes as field 1 (a length-delimited field
    can be written by hand, so no message is built or copied per attach), the lease as field 2."""
    body = manifest_bytes(variant)
    return b"\x0a" + _varint(len(body)) + body + pb.AttachResponse(lease=lease(lease_record)).SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _manifest(variant: Variant) -> pb.Manifest:
    """The variant's slab and tensors; a draft's also name its main variant's slab, whose embedding
    and lm_head it uses by reference."""
    version = variant.version
    parts = [(variant.slab, variant.plan.entries)]
    if variant.base is not None:
        parts.append((variant.base.slab, [e for e in variant.base.plan.entries if e.role in SHARED_ROLES]))
    return pb.Manifest(
        model=variant.name, version=version.number, key=variant.key.to_proto(), config_json=version.config_json,
        slabs=[pb.Slab(id=slab.id, backend=slab.backend, size=slab.size, digest=slab.digest, **slab.export())
               for slab, _ in parts],
        tensors=[pb.TensorEntry(name=e.name, slab=slab.id, offset=e.offset, dtype=str(e.dtype).removeprefix("torch."),
                                shape=e.shape, role=e.role, quant_scheme=e.quant_scheme, nbytes=e.nbytes,
                                quant_params=dict(e.quant_params), part=e.part)
                 for slab, entries in parts for e in entries])


def info(variant: Variant, active: bool | None = None) -> pb.ModelInfo:
    version = variant.version
    return pb.ModelInfo(name=variant.name, version=version.number,
                        active=version.model.active == version.number if active is None else active,
                        state=version.state, path=version.source, key=variant.key.to_proto(),
                        slab_bytes=variant.slab.size, num_tensors=len(variant.plan.entries),
                        leases=[lease(x) for x in variant.leases.values()],
                        loaded_at=variant.loaded_at, load_seconds=variant.load_seconds,
                        stale_reason=version.stale_reason, pinned=version.pinned)


def summary(model: Model) -> pb.ModelSummary:
    return pb.ModelSummary(
        name=model.name, active_version=model.active, last_version=model.last, keep=model.keep,
        max_bytes=model.max_bytes, failures=list(model.failures),
        versions=[pb.VersionSummary(version=v.number, active=v.number == model.active, pinned=v.pinned,
                                    state=v.state, source=v.source, bytes=v.bytes, num_variants=len(v.variants),
                                    num_leases=v.num_leases, created_at=v.created_at)
                  for _, v in sorted(model.versions.items())])


def first_chunk(request_iterator, stall_s: float):
    """A PublishStream's first message (None if the stream ended first), waited for `stall_s` at most:
    a call that holds a load slot and sends nothing would hold it for good."""
    got: queue.Queue = queue.Queue(maxsize=1)

    def read() -> None:
        try:
            got.put(next(request_iterator, None))
        except Exception as e:  # (the client went away: grpc.RpcError)
            got.put(e)

    threading.Thread(target=read, name="publish-header", daemon=True).start()
    try:
        first = got.get(timeout=stall_s)
    except queue.Empty:
        raise InvalidRequestError(f"no publish header for {stall_s:g}s; the publish was dropped") from None
    if isinstance(first, grpc.RpcError):
        raise InvalidRequestError("the publishing client went away before its header; nothing was published")
    if isinstance(first, Exception):
        raise first
    return first


def chunks(request_iterator, context, stall_s: float):
    """The tensor data of a PublishStream after its header, read by a helper thread into a short
    queue (bounded memory). A client that goes away (killed, cancelled, past its deadline), sends
    nothing for `stall_s` seconds, or less than MIN_STREAM_BYTES in any `stall_s` (a byte every few
    seconds held the model's load lock and a whole slab for the hour of --load-timeout) ends the
    publish with an error, not a traceback or a thread held forever."""
    pending: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def read() -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    pending.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False
        try:
            for chunk in request_iterator:
                if not put(chunk):
                    return
            put(None)
        except grpc.RpcError:
            put(_GONE)
        except Exception as e:  # handed to the publishing thread
            put(e)

    threading.Thread(target=read, name="publish-reader", daemon=True).start()
    count, window, window_bytes = 0, 0.0, 0
    try:
        while True:
            try:
                item = pending.get(timeout=stall_s)
            except queue.Empty:
                raise InvalidRequestError(f"no tensor data for {stall_s:g}s after {count} chunk(s); the publish was "
                                          "dropped") from None
            if item is None:
                return
            if item is _GONE:
                raise InvalidRequestError(f"the publishing client went away after {count} chunk(s); nothing was "
                                          "published")
            if isinstance(item, Exception):
                raise item
            if item.WhichOneof("kind") != "data":
                raise InvalidRequestError("a PublishStream sends one header, then only tensor data")
            count += 1
            window_bytes += len(item.data.data)
            if not window:  # from the first data on (the slabs are reserved before it is read)
                window = time.monotonic()
            elif (now := time.monotonic()) - window > stall_s:
                if window_bytes < MIN_STREAM_BYTES:
                    raise InvalidRequestError(f"only {window_bytes} bytes of tensor data in the last {stall_s:g}s "
                                              f"(at least {MIN_STREAM_BYTES >> 20} MiB are expected); so slow a "
                                              "publish was dropped") from None
                window, window_bytes = now, 0
            yield item.data
    finally:
        stop.set()  # the reader's wait on a silent client ends when the servicer ends the call


_GONE = object()
MIN_STREAM_BYTES = 1 << 20  # of tensor data a publish sends in each publish_stall_s
