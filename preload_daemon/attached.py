"""An attached model: one leased variant, its slabs mapped read-only, its tensors views into them.

DaemonClient.attach makes one; this module needs no gRPC (an engine that attaches over its session
never imports grpc), only the manifest's messages and the slab mappings.
"""

import collections.abc
import json
from typing import TYPE_CHECKING

import torch

from preload_daemon.buffers import SlabViews, dtype_from_name
from preload_daemon.cachekey import CacheKey
from preload_daemon.errors import InvalidRequestError
from preload_daemon.plan import Layout
from preload_daemon.slab import map_slab
from protos import preload_pb2 as pb

if TYPE_CHECKING:
    from preload_daemon.client import DaemonClient


class AttachedModel(collections.abc.Mapping):
    """A leased model version: tensors are read-only views into the daemon's slab(s). Attaching maps
    each slab once and indexes the manifest by name; a tensor's view is made when it is first looked
    up (about a microsecond), so attaching costs little more per tensor than decoding the manifest."""

    def __init__(self, client: "DaemonClient", response: pb.AttachResponse):
        self._client = client
        self.manifest = response.manifest
        self.lease_id = response.lease.id
        self.key = CacheKey.from_proto(self.manifest.key)
        self.config = json.loads(self.manifest.config_json) if self.manifest.config_json else {}
        self.slabs: dict[str, torch.Tensor] = {}
        self._views: dict[str, SlabViews] = {}
        for slab in self.manifest.slabs:
            if slab.backend != "host":
                raise InvalidRequestError(f"slab {slab.id} uses backend {slab.backend!r}, which this client "
                                          "cannot map; attach from a process on the daemon's device")
            self.slabs[slab.id] = map_slab(slab.path, slab.size)
            self._views[slab.id] = SlabViews(self.slabs[slab.id])
        entries = self.manifest.tensors
        self._index = dict(zip([t.name for t in entries], range(len(entries))))
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._made.get(name)
        if tensor is None:
            tensor = self._made[name] = self._view(self.manifest.tensors[self._index[name]])
        return tensor

    def _view(self, entry: pb.TensorEntry) -> torch.Tensor:
        views = self._views.get(entry.slab)
        if views is None:
            raise InvalidRequestError(f"tensor {entry.name!r} names slab {entry.slab!r}, which the manifest lacks")
        try:
            return views.view(entry.offset, entry.nbytes, dtype_from_name(entry.dtype), tuple(entry.shape))
        except ValueError as e:
            raise InvalidRequestError(f"tensor {entry.name!r}: {e}") from None

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor's view, by name (made now for those not looked up yet)."""
        if len(self._made) < len(self._index):
            made = self._made
            for entry in self.manifest.tensors:
                if entry.name not in made:
                    made[entry.name] = self._view(entry)
        return dict(self._made)

    def entry(self, name: str) -> pb.TensorEntry:
        """The manifest's entry for `name`: role, quantization scheme and parameters, slab part."""
        return self.manifest.tensors[self._index[name]]

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def layout(self) -> Layout:
        key = self.key
        return Layout(dtype=key.dtype, quantization=key.quantization, tp_size=key.tp_size, tp_rank=key.tp_rank,
                      component=key.component)

    def wait_lost(self, timeout: float) -> bool:
        """True once the daemon is gone (it closed this client's session: exited or was killed),
        and with it this lease; False after `timeout` seconds otherwise."""
        return self._client.wait_session_closed(timeout)

    def renew(self) -> None:
        """Confirms the lease still stands (raises NotFoundError if it was reaped or the daemon restarted)."""
        self._client.renew(self.lease_id)

    def close(self) -> None:
        """Closes the client this lease came from (its session: the daemon ends the lease)."""
        self._client.close()

    def release(self) -> None:
        """Gives the lease back. The views stay readable until this object is garbage-collected."""
        if self.lease_id:
            self._client.release(self.lease_id)
            self.lease_id = ""
