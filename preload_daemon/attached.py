"""An attached model: one leased variant, its slabs mapped read-only, its tensors views into them.

DaemonClient.attach makes one; this module needs no gRPC (an engine that attaches over its session
never imports grpc), only the manifest's messages and the slab mappings.
"""

import collections.abc
import json
import os
from typing import TYPE_CHECKING

import torch

from preload_daemon.buffers import SlabViews, descriptors_of, dtype_from_name, park_mapping, remap_readonly
from preload_daemon.cachekey import CacheKey
from preload_daemon.errors import DeviceError, InvalidRequestError, NotFoundError, PreloadError, StaleError
from preload_daemon.plan import Layout
from preload_daemon.slab import open_slab
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
        for slab in self.manifest.slabs:  # each mapping (or IPC handle) goes with the last view of it
            self.slabs[slab.id] = open_slab(slab, client.device)
            self._views[slab.id] = SlabViews(self.slabs[slab.id])
        entries = self.manifest.tensors
        self._index = dict(zip([t.name for t in entries], range(len(entries))))
        self._made: dict[str, torch.Tensor] = {}
        self._parked: dict[str, list[int]] = {}
        """While suspended: per slab, the descriptor numbers its mapping kept (now on /dev/null)."""

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

    def renew(self, timeout: float | None = None) -> None:
        """Confirms the lease still stands (raises NotFoundError if it was reaped or the daemon restarted)."""
        self._client.renew(self.lease_id, timeout)

    def close(self) -> None:
        """Closes the client this lease came from (its session: the daemon ends the lease). Views
        stay readable while referenced: a host slab's mapping and a CUDA slab's handle go with the
        last view of them."""
        self._client.close()

    @property
    def in_device_memory(self) -> bool:
        """Whether a slab is device (CUDA IPC) memory, which dies with its daemon and cannot be parked."""
        return any(s.backend != "host" for s in self.manifest.slabs)

    @property
    def suspended(self) -> bool:
        return bool(self._parked)

    def suspend(self) -> None:
        """Lets go of the daemon and of its memory without dropping a single view: the lease is
        released and the session closed, and each slab's mapping becomes an empty reservation of
        the same addresses (buffers.park_mapping), its file descriptor pointed at /dev/null. Nothing
        may read a view until resume(). What a process snapshot needs: no weights, no daemon files."""
        if self._parked:
            return
        if self.in_device_memory:
            raise DeviceError("this engine's weights are CUDA IPC memory, which cannot be parked at the same "
                              "addresses: snapshots of GPU engines are not supported yet (restart it warm instead)")
        if self.lease_id:  # ended before the session closes, so the daemon's table is right at once
            try:
                self._client.release(self.lease_id)
            except PreloadError:  # the daemon is gone or ended it already: the session's end suffices
                pass
        self._client.close()
        self.lease_id = ""
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for slab in self.manifest.slabs:  # recorded first: a failure half way still resumes
                self._parked[slab.id] = fds = descriptors_of(slab.path)
                for fd in fds:
                    os.dup2(devnull, fd, inheritable=False)
                raw = self.slabs[slab.id]
                park_mapping(raw.data_ptr(), raw.numel())
        finally:
            os.close(devnull)

    def resume(self, client: "DaemonClient") -> None:
        """Leases the same weights again through `client` and maps them back at the same addresses,
        so every view made before reads them again. Refused (StaleError, still suspended) unless
        the daemon answers with the same cache key, content digest and tensor table; its slabs may
        be new ones (the same weights loaded again make slabs of other names and the same bytes)."""
        try:
            response = client.attach_response(self.manifest.model, self.version, self.layout)
        except NotFoundError as e:  # the version was evicted (a number is never given out again)
            client.close()
            raise StaleError(f"{e}; the snapshot's weights are gone from the daemon: take a new snapshot") from None
        manifest = response.manifest
        key = CacheKey.from_proto(manifest.key)
        if key != self.key or manifest.version != self.version:
            client.close()
            raise StaleError(f"the daemon now holds other weights for {self.manifest.model} v{self.version} "
                             f"({key.content_digest}, not {self.key.content_digest}); take a new snapshot")
        pairs = list(zip(self.manifest.slabs, manifest.slabs))
        old_id = {new.id: old.id for old, new in pairs}
        if [s.size for s in manifest.slabs] != [s.size for s in self.manifest.slabs] \
                or not _same_tensors(manifest.tensors, self.manifest.tensors, old_id):
            client.close()
            raise StaleError(f"the daemon lays out {self.manifest.model} v{self.version} differently now; take a new "
                             "snapshot")
        for old, new in pairs:
            raw = self.slabs[old.id]
            fd = remap_readonly(new.path, raw.data_ptr(), raw.numel())
            for parked in self._parked.get(old.id, ()):
                os.dup2(fd, parked, inheritable=False)
            os.close(fd)
        self.slabs = {new.id: self.slabs[old.id] for old, new in pairs}
        self._views = {new.id: self._views[old.id] for old, new in pairs}
        self._parked = {}
        self._client, self.manifest, self.lease_id = client, manifest, response.lease.id

    def release(self) -> None:
        """Gives the lease back. The views stay readable until this object is garbage-collected."""
        if self.lease_id:
            self._client.release(self.lease_id)
            self.lease_id = ""


def _same_tensors(new, old, old_id: dict[str, str]) -> bool:
    """Whether two tensor tables are one, slab names aside (`old_id`: the old name of each new slab)."""
    return len(new) == len(old) and all(
        old_id.get(a.slab) == b.slab and a.name == b.name and a.offset == b.offset and a.nbytes == b.nbytes
        and a.dtype == b.dtype and a.shape == b.shape and a.role == b.role and a.part == b.part
        and a.quant_scheme == b.quant_scheme and a.quant_params == b.quant_params for a, b in zip(new, old))
