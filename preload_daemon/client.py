"""The client library: talk to a per-device daemon and map its slabs zero-copy.

    with DaemonClient.for_device("cpu:0") as client:
        client.load(LoadSpec(path="/models/llama"))
        model = client.attach("llama")          # a Mapping {name: tensor}, views into the slab
        logits = model["lm_head.weight"] @ h
        model.release()
"""

import collections.abc
import json
import os
import pathlib

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from preload_daemon.buffers import dtype_from_name, typed_view
from preload_daemon.cachekey import CacheKey
from preload_daemon.config import default_runtime_dir, parse_device, socket_path
from preload_daemon.errors import InvalidRequestError, from_rpc_error
from preload_daemon.plan import LoadSpec
from preload_daemon.slab import map_slab
from protos import preload_pb2 as pb
from protos import preload_pb2_grpc as pb_grpc


class AttachedModel(collections.abc.Mapping):
    """A leased model version: tensors are read-only views into the daemon's slab(s)."""

    def __init__(self, client: "DaemonClient", response: pb.AttachResponse):
        self._client = client
        self.manifest = response.manifest
        self.lease_id = response.lease.id
        self.key = CacheKey.from_proto(self.manifest.key)
        self.config = json.loads(self.manifest.config_json) if self.manifest.config_json else {}
        self.slabs: dict[str, torch.Tensor] = {}
        for slab in self.manifest.slabs:
            if slab.backend != "host":
                raise InvalidRequestError(f"slab {slab.id} uses backend {slab.backend!r}, which this client "
                                          "cannot map; attach from a process on the daemon's device")
            self.slabs[slab.id] = map_slab(slab.path, slab.size)
        self.tensors: dict[str, torch.Tensor] = {
            t.name: typed_view(self.slabs[t.slab], t.offset, t.nbytes, dtype_from_name(t.dtype), tuple(t.shape))
            for t in self.manifest.tensors}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def version(self) -> int:
        return self.manifest.version

    def renew(self) -> None:
        """Confirms the lease still stands (raises NotFoundError if it was reaped or the daemon restarted)."""
        self._client.renew(self.lease_id)

    def release(self) -> None:
        """Gives the lease back. The views stay readable until this object is garbage-collected."""
        if self.lease_id:
            self._client.release(self.lease_id)
            self.lease_id = ""


class DaemonClient:
    def __init__(self, path: str | os.PathLike, timeout: float = 30.0):
        self.path = pathlib.Path(path)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix:{self.path}", options=[
            ("grpc.max_receive_message_length", 256 << 20), ("grpc.enable_http_proxy", 0)])
        self._stub = pb_grpc.WeightCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @classmethod
    def for_device(cls, device: str = "cpu:0", runtime_dir: str | os.PathLike | None = None,
                   timeout: float = 30.0) -> "DaemonClient":
        runtime = pathlib.Path(runtime_dir) if runtime_dir else default_runtime_dir()
        return cls(socket_path(runtime, parse_device(device)), timeout)

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def load(self, spec: LoadSpec, on_progress=None, timeout: float | None = None) -> pb.ModelInfo:
        """Loads a checkpoint (or finds it loaded); `on_progress(pb.LoadProgress)` sees the stream."""
        request = pb.LoadModelRequest(spec=pb.LoadSpec(
            path=os.path.abspath(spec.path), name=spec.name, dtype=spec.dtype, quantization=spec.quantization,
            tp_size=spec.tp_size, tp_rank=spec.tp_rank, component=spec.component))
        try:
            for update in self._stub.LoadModel(request, timeout=timeout):
                if on_progress is not None:
                    on_progress(update)
                if update.HasField("model"):
                    return update.model
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        raise InvalidRequestError("the daemon ended the load stream without a result; see its log")

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self._call(self._stub.ListModels, pb.ListModelsRequest()).models)

    def attach(self, model: str, version: int = 0, expect: CacheKey | None = None) -> AttachedModel:
        request = pb.AttachRequest(model=model, version=version, check_expect=expect is not None,
                                   expect=expect.to_proto() if expect is not None else None)
        return AttachedModel(self, self._call(self._stub.Attach, request))

    def renew(self, lease_id: str) -> pb.Lease:
        return self._call(self._stub.RenewLease, pb.RenewLeaseRequest(lease_id=lease_id)).lease

    def release(self, lease_id: str) -> None:
        self._call(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id))

    def evict(self, model: str, version: int = 0, force: bool = False) -> list[pb.ModelInfo]:
        return list(self._call(self._stub.Evict, pb.EvictRequest(model=model, version=version, force=force)).evicted)

    def stats(self, timeout: float | None = None) -> pb.Stats:
        return self._call(self._stub.GetStats, pb.GetStatsRequest(), timeout)

    def serving(self, timeout: float = 2.0) -> bool:
        """The standard health check: True once the daemon has loaded models and no load is in flight."""
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(), timeout)
        return response.status == health_pb2.HealthCheckResponse.SERVING


def attach(model: str, device: str = "cpu:0", runtime_dir: str | os.PathLike | None = None,
           version: int = 0, expect: CacheKey | None = None) -> AttachedModel:
    """Attaches to `model` on the daemon for `device`: {name: tensor} views, zero-copy, leased."""
    client = DaemonClient.for_device(device, runtime_dir)
    return client.attach(model, version, expect)
