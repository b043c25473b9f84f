"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA devices).

Rank 0 tokenizes, schedules and serves; every forward it runs is first announced to the other
ranks (`Leader.forward` broadcasts the step), which run the same forward on their shards (`follow`)
so that the group's all-reduces and all-gathers line up. Nothing crosses the group but tensors:
small JSON documents (readiness, timings) travel as uint8 tensors, never pickled.
"""

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from preload_daemon.config import cuda_ordinal
from preload_daemon.errors import PreloadError

log = logging.getLogger(__name__)

# What the followers run: nothing more, the model, the draft, the MTP step, a copy of one slot's cache
# into others (slots: [source, *targets]; input_ids[0, 0]: how many positions).
STOP, FORWARD, DRAFT, MTP, COPY = 0, 1, 2, 3, 4
HEADER = 4  # op, batch, tokens per row, flags (1: all logits, 2: hidden states too)
JSON_BYTES = 1 << 16
# Followers wait in a broadcast while the engine is idle, which may last days; a dead peer ends the
# wait at once (its connections close), so this bound only catches a peer that hangs while alive.
IDLE_TIMEOUT = datetime.timedelta(days=30)


class ParallelError(PreloadError):
    """The tensor-parallel group could not form, or broke (a rank died or hung)."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Rendezvous:
    """Where the ranks of one engine meet: rank 0 hosts a TCP store at addr:port, the others connect."""

    rank: int
    size: int
    addr: str = "127.0.0.1"
    port: int = 0
    env: bool = False
    """Join through torchrun's environment (MASTER_ADDR, MASTER_PORT) instead."""


class TPGroup:
    """One rank's membership of the group: the collectives the model needs, plus the step channel."""

    def __init__(self, rendezvous: Rendezvous, device: str = "cpu"):
        self.rank, self.size = rendezvous.rank, rendezvous.size
        ordinal = cuda_ordinal(device)
        self.device = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)
        try:
            self.store = None if rendezvous.env else dist.TCPStore(
                rendezvous.addr, rendezvous.port, self.size, is_master=self.rank == 0, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=120))
        except RuntimeError as e:
            raise ParallelError(f"rank {self.rank} could not reach the rendezvous at {rendezvous.addr}:"
                                f"{rendezvous.port}: {e}") from e

    def join(self) -> "TPGroup":
        """Blocks until every rank has joined."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        how = {"store": self.store} if self.store else {"init_method": "env://"}
        dist.init_process_group(backend, rank=self.rank, world_size=self.size, timeout=IDLE_TIMEOUT, **how)
        return self

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- what the model calls ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's `x` along the last dimension (vocabulary-parallel logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    # -- coordination ----------------------------------------------------------------------------

    def exchange(self, document: dict) -> list[dict]:
        """Every rank's JSON `document`, by rank."""
        data = json.dumps(document).encode()
        if len(data) > JSON_BYTES - 8:
            raise ValueError(f"document of {len(data)} bytes exceeds the {JSON_BYTES}-byte limit")
        buffer = torch.zeros(JSON_BYTES, dtype=torch.uint8, device=self.device)
        buffer[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        buffer[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(buffer) for _ in range(self.size)]
        dist.all_gather(parts, buffer)
        out = []
        for part in parts:
            raw = part.cpu().numpy().tobytes()
            out.append(json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]))
        return out

    def send_step(self, op: int, input_ids=None, positions=None, slots=None, all_logits: bool = False,
                  hidden: bool = False, states: torch.Tensor | None = None) -> None:
        """Announces a forward: `op` with its token ids, positions and slots ([B, T], [B, T], [B]);
        an MTP step also sends its input states ([B, T, H] in the model's dtype)."""
        if op == STOP:
            dist.broadcast(torch.tensor([STOP, 0, 0, 0], device=self.device), 0)
            return
        batch, t = input_ids.shape
        dist.broadcast(torch.tensor([op, batch, t, int(all_logits) | 2 * int(hidden)], device=self.device), 0)
        dist.broadcast(torch.cat([input_ids.reshape(-1), positions.reshape(-1), slots.reshape(-1)])
                       .to(torch.int64).to(self.device), 0)
        if op == MTP:
            dist.broadcast(states.contiguous().to(self.device), 0)

    def receive_step(self, states_like: torch.Tensor | None = None):
        """(op, input_ids, positions, slots, all_logits, hidden, states) as rank 0 sent it;
        `states_like` gives the dtype and width of an MTP step's states."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(header, 0)
        op, batch, t, flags = header.tolist()
        if op == STOP:
            return STOP, None, None, None, False, False, None
        data = torch.empty(2 * batch * t + batch, dtype=torch.int64, device=self.device)
        dist.broadcast(data, 0)
        data = data.cpu()
        n = batch * t
        states = None
        if op == MTP:
            states = torch.empty(batch, t, states_like.shape[-1], dtype=states_like.dtype, device=self.device)
            dist.broadcast(states, 0)
        return (op, data[:n].view(batch, t), data[n:2 * n].view(batch, t), data[2 * n:], bool(flags & 1),
                bool(flags & 2), states)


class Leader:
    """Rank 0's model: what the engine sees. Each forward is announced to the followers first."""

    def __init__(self, model, group: TPGroup):
        self.model, self.group = model, group
        self.spec, self.dtype = model.spec, model.dtype
        self.closed = False
        self.on_broken: Callable[[str], None] = lambda reason: None
        """Called once the group is found broken: the engine cannot serve any more."""
        self.step_since = 0.0
        """When the step under way started (time.monotonic), 0.0 between steps: a rank that stops
        (SIGSTOP) or hangs holds every collective, with no error (main.watch_followers times it)."""

    def new_cache(self, num_slots: int, max_len: int):
        return self.model.new_cache(num_slots, max_len)

    def forward(self, input_ids, positions, cache, slots, all_logits: bool = False, hidden: bool = False):
        return self._run(FORWARD, self.model.forward, input_ids, positions, cache, slots, all_logits, hidden)

    def copy_cache(self, cache, source: int, targets: list[int], length: int) -> None:
        slots = torch.tensor([source, *targets])
        ids = torch.full((len(slots), 1), length)
        self.step_since = time.monotonic()
        try:
            self.group.send_step(COPY, ids, torch.zeros_like(ids), slots)
        except RuntimeError as e:
            raise self._broken(e) from e
        finally:
            self.step_since = 0.0
        self.model.copy_cache(cache, source, targets, length)

    def draft(self, model) -> "LeaderDraft":
        """Rank 0's view of the draft model (whose shards the followers hold too)."""
        return LeaderDraft(self, model)

    def _run(self, op: int, method, input_ids, positions, cache, slots, all_logits=False, hidden=False, states=None):
        self.step_since = time.monotonic()
        try:
            self.group.send_step(op, input_ids, positions, slots, all_logits, hidden, states)
            if op == MTP:
                return method(input_ids, states, positions, cache, slots)
            return method(input_ids, positions, cache, slots, all_logits, hidden)
        except RuntimeError as e:  # gloo/NCCL report a lost peer as RuntimeError subclasses
            raise self._broken(e) from e
        finally:
            self.step_since = 0.0

    def _broken(self, error: RuntimeError) -> ParallelError:
        """The error to raise for a collective that failed, once on_broken has been told."""
        reason = f"the tensor-parallel group broke: {error}"
        self.on_broken(reason)
        return ParallelError(reason)

    def close(self) -> None:
        """Tells the followers to exit (once)."""
        if not self.closed:
            self.closed = True
            try:
                self.group.send_step(STOP)
            except RuntimeError as e:
                log.warning("could not tell the other ranks to stop: %s", e)


class LeaderDraft:
    """Rank 0's draft model (a separate CausalLM, or the MTP layer): each of its forwards is
    announced to the followers first, like the main model's."""

    def __init__(self, leader: Leader, model):
        self.leader, self.model = leader, model
        self.spec, self.dtype = model.spec, model.dtype

    def new_cache(self, num_slots: int, max_len: int):
        return self.model.new_cache(num_slots, max_len)

    def forward(self, input_ids, positions, cache, slots, all_logits: bool = False, hidden: bool = False):
        return self.leader._run(DRAFT, self.model.forward, input_ids, positions, cache, slots, all_logits, hidden)

    def step(self, input_ids, states, positions, cache, slots):
        return self.leader._run(MTP, self.model.step, input_ids, positions, cache, slots, states=states)


def follow(model, group: TPGroup, num_slots: int, max_len: int, draft=None) -> None:
    """A follower rank's life after loading: run every forward rank 0 announces (the model's, and
    the draft's when it speculates), until it says stop."""
    cache = model.new_cache(num_slots, max_len)
    draft_cache = draft.new_cache(num_slots, max_len) if draft is not None else None
    states_like = torch.empty(0, model.spec.hidden_size, dtype=model.dtype)
    while True:
        try:
            op, input_ids, positions, slots, all_logits, hidden, states = group.receive_step(states_like)
        except RuntimeError as e:
            raise ParallelError(f"rank {group.rank} lost rank 0: {e}") from e
        if op == STOP:
            return
        if op == FORWARD:
            model.forward(input_ids, positions, cache, slots, all_logits, hidden)
        elif op == COPY:
            model.copy_cache(cache, int(slots[0]), slots[1:].tolist(), int(input_ids[0, 0]))
        elif op == DRAFT:
            draft.forward(input_ids, positions, draft_cache, slots, all_logits, hidden)
        else:
            draft.step(input_ids, states, positions, draft_cache, slots)
