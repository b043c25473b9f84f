"""The client library: talk to a per-device daemon, map its slabs zero-copy, publish versions.

    with DaemonClient.for_device("cpu:0") as client:
        client.load(LoadSpec(path="/models/llama"))
        model = client.attach("llama")          # a Mapping {name: tensor}, views into the slab
        logits = model["lm_head.weight"] @ h
        model.release()

        # A trainer publishes its live weights as the next version, without writing them to disk:
        client.publish("llama", trainer_model.state_dict(), trainer_model.config.to_dict())

Publishing to every TP rank's daemon at once, with the pointer moved only when all are ready, is
`preload_daemon.versions.publish_tensors`. The attached model itself (the mapped slabs and the
views into them) is attached.py's.
"""

import collections.abc
import dataclasses
import errno
import json
import os
import pathlib
import select
import socket
import threading

import torch

from preload_daemon.attached import AttachedModel
from preload_daemon.buffers import dtype_name
from preload_daemon.config import default_runtime_dir, parse_device
from preload_daemon.errors import (AccessDeniedError, DaemonUnavailableError, InvalidRequestError, PreloadError,
                                   from_details, from_rpc_error)
from preload_daemon.plan import Layout, LoadSpec
from preload_daemon.runtime_dir import check_daemon_socket, socket_path
from preload_daemon.safetensors_file import FileIdentity
from preload_daemon.session_client import REFUSED, SessionAnswerError, SessionError, open_session, request
from preload_daemon.sessions import ATTACH, session_path
from protos import preload_pb2 as pb

CHUNK_BYTES = 4 << 20
MAX_SEND = 64 << 20  # bytes of one message to the daemon (what it receives at most, by default)
MAX_CHUNK_BYTES = 32 << 20


class DaemonClient:
    """A connection to one daemon. Attach travels on the client's session (one round trip, no gRPC
    channel); every other call is a gRPC call on a channel opened at its first use."""

    def __init__(self, path: str | os.PathLike, timeout: float = 30.0):
        self.path = pathlib.Path(path)
        self.timeout = timeout
        self.device: str | None = None
        """The daemon's device, where known (for_device): what a CUDA slab's GPU must be."""
        self._channel = None
        self._stub_cache = None
        self._health_cache = None
        self._channel_lock = threading.Lock()
        self._session = None
        self._session_lock = threading.Lock()

    @property
    def _stub(self):
        if self._stub_cache is None:
            self._open_channel()
        return self._stub_cache

    @property
    def _health(self):
        if self._health_cache is None:
            self._open_channel()
        return self._health_cache

    def _open_channel(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2_grpc

        from protos import preload_pb2_grpc as pb_grpc
        check_daemon_socket(self.path)
        with self._channel_lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(f"unix:{self.path}", options=[
                    ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", MAX_SEND),
                    ("grpc.enable_http_proxy", 0)])
                self._health_cache = health_pb2_grpc.HealthStub(self._channel)
                self._stub_cache = pb_grpc.WeightCacheStub(self._channel)

    @classmethod
    def for_device(cls, device: str = "cpu:0", runtime_dir: str | os.PathLike | None = None,
                   timeout: float = 30.0) -> "DaemonClient":
        runtime = pathlib.Path(runtime_dir) if runtime_dir else default_runtime_dir()
        client = cls(socket_path(runtime, parse_device(device)), timeout)
        client.device = parse_device(device)
        return client

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel and the session: the daemon ends this client's leases."""
        with self._channel_lock:
            if self._channel is not None:
                self._channel.close()
        with self._session_lock:
            if self._session is not None:
                self._session[0].close()
                self._session = None

    def _call(self, method, request, timeout: float | None = None):
        import grpc
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            if e.code().name == "DEADLINE_EXCEEDED" and not from_details(e.details() or ""):
                raise DaemonUnavailableError(
                    f"the daemon on {self.path} did not answer within {timeout or self.timeout:g}s: it may be hung "
                    "or stopped (SIGSTOP); see its log beside the socket, or restart it") from None
            raise self._error(e) from None

    def _error(self, error) -> PreloadError:
        """The PreloadError for a grpc.RpcError."""
        if error.code().name == "UNAVAILABLE" and "permission denied" in (error.details() or "").lower():
            return access_denied(self.path)
        return from_rpc_error(error)

    def session(self) -> str:
        """The token of this client's session with the daemon, opened on first use and kept open
        for the client's life: the daemon ties this client's leases to this process through it."""
        with self._session_lock:
            return self._open_session()[1]

    def _open_session(self) -> tuple[socket.socket, str]:
        """(socket, token) of the session, (re)opened if needed; the caller holds _session_lock."""
        if self._session is not None and _closed_by_peer(self._session[0], 0):
            self._session[0].close()  # its daemon is gone: a new one needs a new session
            self._session = None
        if self._session is None:
            path = session_path(self.path)
            try:
                self._session = open_session(path, min(self.timeout, 10.0))
            except SessionError as e:
                if e.errno == errno.EACCES:
                    raise access_denied(self.path, str(e)) from None
                if e.errno == REFUSED:  # the daemon runs, and said why (its reason names the fix)
                    raise DaemonUnavailableError(f"the daemon on {self.path} refused a session: {e.strerror}") from None
                raise DaemonUnavailableError(f"{e}; start the daemon with `preload daemon` or `preload serve`") \
                    from None
        return self._session

    def _session_request(self, kind: int, payload: bytes) -> bytes:
        """One request on the session (session_client.request), with errors mapped to PreloadErrors."""
        with self._session_lock:
            sock, _ = self._open_session()
            try:
                return request(sock, kind, payload, self.timeout)
            except SessionAnswerError as e:
                raise from_details(str(e)) or PreloadError(str(e)) from None
            except SessionError as e:
                sock.close()
                self._session = None
                raise DaemonUnavailableError(f"the daemon on {self.path} did not answer: {e.strerror or e}; is it "
                                             "running? (`preload status`)") from None

    def wait_session_closed(self, timeout: float) -> bool:
        """True once the daemon closed this client's session (it exited or was killed): the
        leases of this client are gone. Returns False after `timeout` seconds otherwise."""
        with self._session_lock:
            sock = self._session[0] if self._session is not None else None
        return sock is None or _closed_by_peer(sock, timeout)

    def load(self, spec: LoadSpec, on_progress=None, timeout: float | None = None, *,
             layouts: tuple[Layout, ...] = (), version: int = 0, activate: bool = True,
             keep: int | None = None, max_bytes: int | None = None) -> pb.ModelInfo:
        """Loads a checkpoint's variant (spec's layout, plus `layouts`) into the version loaded from
        the same files, or into a new version (numbered `version`, or the next) that becomes active
        if `activate`. `on_progress(pb.LoadProgress)` sees the stream; returns spec's variant (the
        final message's `variants` has them all: see load_all)."""
        return self.load_all(spec, on_progress, timeout, layouts=layouts, version=version, activate=activate,
                             keep=keep, max_bytes=max_bytes)[0]

    def load_all(self, spec: LoadSpec, on_progress=None, timeout: float | None = None, *,
                 layouts: tuple[Layout, ...] = (), version: int = 0, activate: bool = True,
                 keep: int | None = None, max_bytes: int | None = None) -> list[pb.ModelInfo]:
        request = pb.LoadModelRequest(
            spec=pb.LoadSpec(path=os.path.abspath(spec.path), name=spec.name, dtype=spec.dtype,
                             quantization=spec.quantization, tp_size=spec.tp_size, tp_rank=spec.tp_rank,
                             component=spec.component),
            layouts=[_layout(x) for x in layouts], version=version, activate=activate,
            retention=_retention(keep, max_bytes))
        import grpc
        try:
            for update in self._stub.LoadModel(request, timeout=timeout):
                if on_progress is not None:
                    on_progress(update)
                if update.HasField("model"):
                    return list(update.variants) or [update.model]
        except grpc.RpcError as e:
            raise self._error(e) from None
        raise InvalidRequestError("the daemon ended the load stream without a result; see its log")

    def publish(self, name: str, tensors, config: dict, *, version: int = 0, layouts: tuple[Layout, ...] = (),
                activate: bool = True, keep: int | None = None, max_bytes: int | None = None, label: str = "",
                chunk_bytes: int = CHUNK_BYTES, on_progress=None, timeout: float | None = None) -> list[pb.ModelInfo]:
        """Publishes a new version of `name` from tensors in this process ({name: tensor}, e.g. a
        live model's state_dict(), named as in its Hugging Face checkpoint) and its config.json as a
        dict. Streams tensor after tensor in chunks: this side holds one chunk (plus one tensor when
        it is on a GPU or not contiguous), the daemon one tensor. Aliased tensors (tied embeddings)
        are sent once. Returns the new version's variants. `on_progress(bytes_sent, bytes_total)`."""
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidRequestError(f"chunk_bytes={chunk_bytes} must be between 1 and {MAX_CHUNK_BYTES >> 20} MiB "
                                      f"(a message to the daemon holds at most {MAX_SEND >> 20} MiB); the default is "
                                      f"{CHUNK_BYTES >> 20} MiB")
        items = _unique_tensors(tensors)
        header = pb.PublishHeader(
            model=name, version=version, config_json=json.dumps(config), layouts=[_layout(x) for x in layouts],
            activate=activate, retention=_retention(keep, max_bytes), label=label,
            tensors=[pb.TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in items])
        total = sum(t.numel() * t.element_size() for _, t in items)
        if header.ByteSize() > MAX_SEND:
            raise InvalidRequestError(f"the publish header (the names, dtypes and shapes of {len(items)} tensors, and "
                                      f"the config) is {header.ByteSize() >> 20} MiB, over the {MAX_SEND >> 20} MiB a "
                                      "message to the daemon may be; check the tensor names")

        def chunks():
            yield pb.PublishChunk(header=header)
            sent = 0
            for index, (_, tensor) in enumerate(items):
                data = tensor.detach().to("cpu").contiguous().reshape(-1)
                raw = memoryview(data.view(torch.uint8).numpy()) if data.numel() else memoryview(b"")
                for offset in range(0, len(raw), chunk_bytes):
                    piece = raw[offset:offset + chunk_bytes]
                    yield pb.PublishChunk(data=pb.TensorData(index=index, offset=offset, data=piece.tobytes()))
                    sent += len(piece)
                    if on_progress is not None:
                        on_progress(sent, total)

        import grpc
        try:  # no deadline unless given: a large model streams for minutes (the daemon drops a stalled one)
            return list(self._stub.PublishStream(chunks(), timeout=timeout).variants)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def set_active(self, model: str, version: int) -> pb.ModelSummary:
        return self._call(self._stub.SetActive, pb.SetActiveRequest(model=model, version=version))

    def pin(self, model: str, version: int, pinned: bool = True) -> pb.ModelSummary:
        return self._call(self._stub.Pin, pb.PinRequest(model=model, version=version, pinned=pinned))

    def list_models(self) -> list[pb.ModelInfo]:
        """Every variant of every version."""
        return list(self._call(self._stub.ListModels, pb.ListModelsRequest()).models)

    def summaries(self) -> list[pb.ModelSummary]:
        """Per model name: versions, the active one, pins, retention, recent failures."""
        return list(self._call(self._stub.ListModels, pb.ListModelsRequest()).summaries)

    def attach(self, model: str, version: int = 0, layout: Layout | None = None,
               files: tuple[FileIdentity, ...] = ()) -> AttachedModel:
        """Leases the variant `layout` (default: the version's first main variant) of `version`, else
        of the version loaded from `files` (checkpoint.stat_identity of the caller's checkpoint),
        else of the active version."""
        return AttachedModel(self, self.attach_response(model, version, layout, files))

    def attach_response(self, model: str, version: int = 0, layout: Layout | None = None,
                        files: tuple[FileIdentity, ...] = ()) -> pb.AttachResponse:
        """attach's lease and manifest, with nothing mapped (the lease lasts as long as this client)."""
        message = pb.AttachRequest(model=model, version=version,
                                   files=[pb.FileIdentity(**dataclasses.asdict(f)) for f in files])
        if layout is not None:
            message.layout.CopyFrom(_layout(layout))
        return pb.AttachResponse.FromString(self._session_request(ATTACH, message.SerializeToString()))

    def renew(self, lease_id: str, timeout: float | None = None) -> pb.Lease:
        return self._call(self._stub.RenewLease, pb.RenewLeaseRequest(lease_id=lease_id, session=self.session()),
                          timeout).lease

    def release(self, lease_id: str) -> None:
        self._call(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id, session=self.session()))

    def evict(self, model: str, version: int = 0, force: bool = False) -> list[pb.ModelInfo]:
        return list(self._call(self._stub.Evict, pb.EvictRequest(model=model, version=version, force=force)).evicted)

    def verify(self, model: str = "", version: int = 0, timeout: float | None = None) -> pb.VerifyResponse:
        """Has the daemon re-hash its slabs (of `model`, `version`; all by default) against the
        digests they were sealed with."""
        return self._call(self._stub.Verify, pb.VerifyRequest(model=model, version=version), timeout)

    def stats(self, timeout: float | None = None) -> pb.Stats:
        return self._call(self._stub.GetStats, pb.GetStatsRequest(), timeout)

    def serving(self, timeout: float = 2.0) -> bool:
        """The standard health check: True once the daemon has loaded models and no load is in flight."""
        from grpc_health.v1 import health_pb2
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(), timeout)
        return response.status == health_pb2.HealthCheckResponse.SERVING


def attach(model: str, device: str = "cpu:0", runtime_dir: str | os.PathLike | None = None,
           version: int = 0, layout: Layout | None = None) -> AttachedModel:
    """Attaches to `model` on the daemon for `device`: {name: tensor} views, zero-copy, leased."""
    client = DaemonClient.for_device(device, runtime_dir)
    return client.attach(model, version, layout)


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the daemon closed this session socket (waiting up to `timeout` seconds to see)."""
    poller = select.poll()  # not select(): that fails on descriptors >= 1024
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    try:
        if not poller.poll(timeout * 1000):
            return False
        return not sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)  # b"": the daemon's EOF
    except BlockingIOError:
        return False
    except OSError:
        return True


def access_denied(path: pathlib.Path, detail: str = "") -> AccessDeniedError:
    """The error a stranger gets: the kernel refused the connection because the daemon's runtime
    directory and sockets belong to another user."""
    try:
        owner = path.parent.stat().st_uid
    except OSError:
        owner = -1
    whose = f"this daemon serves uid {owner}" if owner >= 0 else "this daemon serves another user"
    detail = f": {detail}" if detail else ""
    return AccessDeniedError(f"permission denied: {whose}, and you are uid {os.getuid()} ({path}{detail}); "
                             "run your own daemon with `preload daemon`, or set PRELOAD_RUNTIME_DIR to a directory "
                             "of your own")


def _layout(layout: Layout) -> pb.Layout:
    return pb.Layout(dtype=layout.dtype, quantization=layout.quantization, tp_size=layout.tp_size,
                     tp_rank=layout.tp_rank, component=layout.component)


def _retention(keep: int | None, max_bytes: int | None) -> pb.Retention:
    retention = pb.Retention()
    if keep is not None:
        retention.keep = keep
    if max_bytes is not None:
        retention.max_bytes = max_bytes
    return retention


def _unique_tensors(tensors) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, each storage sent once: a tensor that aliases an earlier one (a tied
    lm_head) is left out, as save_pretrained leaves it out of a checkpoint."""
    items = tensors.items() if isinstance(tensors, collections.abc.Mapping) else tensors
    seen, out = set(), []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        alias = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype) \
            if tensor.numel() else None
        if alias is not None and alias in seen:
            continue
        seen.add(alias)
        out.append((name, tensor))
    return out
