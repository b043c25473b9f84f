"""The generation engine: one scheduler thread runs prefill for new requests and batched decode for
all running ones over a static per-slot KV cache. Requests arrive from any thread; their tokens go
back through a callback as they are produced."""

import dataclasses
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from preload_daemon.errors import InvalidRequestError
from worker.model import CausalLM
from worker.speculative import Speculator, accept, probabilities

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    seed: int | None = None
    """With temperature > 0, the same seed gives the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Added to the model's end-of-sequence tokens."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(slots=True)
class Request:
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[int], None]
    on_done: Callable[[str], None]
    """Called once with the finish reason: "stop", "length" or "error: ..."."""
    generator: torch.Generator | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    stop_ids: frozenset = frozenset()
    cancelled: bool = False
    """Set from any thread (a stop string matched, the client went away): ends with "stop"."""


@dataclasses.dataclass(slots=True)
class Result:
    tokens: list[int]
    finish_reason: str
    seconds: float


class Engine:
    def __init__(self, model: CausalLM, max_batch: int = 8, max_len: int = 2048,
                 speculator: Speculator | None = None):
        """With a `speculator`, its draft proposes tokens that one main forward per step verifies
        (worker/speculative.py); the caches get room for the K positions a step may look ahead."""
        self.model = model
        self.max_len = model.spec.context_len(max_len)
        self.speculator = speculator
        ahead = speculator.k if speculator else 0
        self.cache = model.new_cache(max_batch, self.max_len + ahead)
        self.draft = speculator.runner(max_batch, self.max_len + ahead) if speculator else None
        self._pending: queue.Queue[Request | None] = queue.Queue()
        self._free = list(range(max_batch))
        """A heap: a new request takes the lowest free slot, so running requests tend to hold
        consecutive slots, whose caches a batched step reads as one view (worker/model.py)."""
        self._running: list[Request] = []
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0}
        if speculator is not None:
            self.stats.update(spec_proposed=0, spec_accepted=0, spec_verified=0, spec_emitted=0)

    def speculation(self) -> dict:
        """Acceptance rate, mean accepted length and tokens per main forward, per sequence (a step
        verifies every running sequence in one forward) so far."""
        if self.speculator is None:
            return {}
        s = self.stats
        verified = max(s["spec_verified"], 1)
        return {"kind": self.speculator.kind, "num_speculative_tokens": self.speculator.k,
                "proposed": s["spec_proposed"], "accepted": s["spec_accepted"],
                "acceptance_rate": s["spec_accepted"] / max(s["spec_proposed"], 1),
                "mean_accepted_length": s["spec_accepted"] / verified,
                "tokens_per_main_forward": s["spec_emitted"] / verified}

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._pending.put(None)
        self._thread.join()

    def submit(self, prompt: list[int], params: SamplingParams, on_token: Callable[[int], None],
               on_done: Callable[[str], None]) -> Request:
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.max_len:
            raise InvalidRequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                      f"engine's max length {self.max_len}; shorten one of them")
        vocab = self.model.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model.spec.eos_token_ids))
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        request = Request(prompt, params, on_token, on_done, generator, stop_ids=frozenset(stop))
        self._pending.put(request)
        return request

    def generate(self, prompt: list[int], params: SamplingParams) -> Result:
        """Blocking convenience: all tokens of one request."""
        tokens, done = [], threading.Event()
        reason = []
        start = time.perf_counter()
        self.submit(prompt, params, tokens.append, lambda r: (reason.append(r), done.set()))
        done.wait()
        if reason[0].startswith("error"):
            raise RuntimeError(reason[0])
        return Result(tokens, reason[0], time.perf_counter() - start)

    def _loop(self) -> None:
        while True:
            block = not self._running
            arrived = []
            while len(arrived) < len(self._free):
                try:
                    request = self._pending.get(block=block)
                except queue.Empty:
                    break
                if request is None:  # stopping: what arrived with it, and what runs, ends here
                    self._abandon(arrived + self._running)
                    return
                block = False
                arrived.append(request)
            # Prompts of one length prefill together: one forward reads the weights once for all.
            for _, group in itertools.groupby(sorted(arrived, key=lambda r: len(r.prompt)), lambda r: len(r.prompt)):
                self._prefill(list(group))
            if self._running:
                self._decode()

    def _prefill(self, requests: list[Request]) -> None:
        for request in requests:
            request.slot = heapq.heappop(self._free)
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += len(request.prompt)
        try:
            ids = torch.tensor([r.prompt for r in requests])
            positions = torch.arange(ids.shape[1]).expand(len(requests), -1)
            slots = torch.tensor([r.slot for r in requests])
            if self.speculator is None:
                logits = self.model.forward(ids, positions, self.cache, slots)
            else:
                logits, states = self.model.forward(ids, positions, self.cache, slots, hidden=True)
                for row, request in enumerate(requests):
                    self.draft.prefilled(request.slot, request.prompt, states[row])
        except Exception as e:
            log.exception("prefill failed")
            for request in requests:
                self._finish(request, f"error: {e}")
            return
        for row, request in enumerate(requests):
            self._running.append(request)
            self._emit(request, self._sample(logits[row], request))

    def _decode(self) -> None:
        if self.speculator is not None:
            self._speculate()
            return
        batch = sorted(self._running, key=lambda r: r.slot)
        ids = torch.tensor([[r.output[-1]] for r in batch])
        positions = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r in batch])
        slots = torch.tensor([r.slot for r in batch])
        try:
            logits = self.model.forward(ids, positions, self.cache, slots)
        except Exception as e:
            log.exception("decode failed")
            for r in list(batch):
                self._finish(r, f"error: {e}")
            return
        self.stats["decode_steps"] += 1
        greedy = logits.argmax(-1).tolist()  # one call for the batch's greedy rows
        for row, request in enumerate(batch):
            token = greedy[row] if request.params.temperature == 0 else self._sample(logits[row], request)
            self._emit(request, token)

    def _speculate(self) -> None:
        """One speculative step for every running request: propose, verify in one forward, keep the
        accepted prefix and the main model's next token."""
        batch, draft, k = sorted(self._running, key=lambda r: r.slot), self.draft, self.speculator.k
        mtp = self.speculator.kind == "mtp"
        try:
            proposals, lengths = [], []
            for r in batch:
                tokens = r.prompt + r.output
                lengths.append(len(tokens))
                proposals.append(draft.propose(r.slot, tokens, k, lambda logits, r=r: self._draft_pick(logits, r)))
            ids = torch.tensor([[r.output[-1], *p.tokens] for r, p in zip(batch, proposals)])
            positions = torch.tensor([[n - 1 + i for i in range(k + 1)] for n in lengths])
            slots = torch.tensor([r.slot for r in batch])
            out = self.model.forward(ids, positions, self.cache, slots, all_logits=True, hidden=mtp)
            logits, states = out if mtp else (out, None)
        except Exception as e:
            log.exception("speculative decode failed")
            for r in batch:
                self._finish(r, f"error: {e}")
            return
        self.stats["decode_steps"] += 1
        for row, (request, proposal, n) in enumerate(zip(batch, proposals, lengths)):
            params = request.params
            accepted, token = accept(logits[row], proposal, params.temperature, params.top_p, request.generator)
            draft.verified(request.slot, n, k, accepted, states[row] if states is not None else None)
            self.stats["spec_proposed"] += k
            self.stats["spec_accepted"] += accepted
            self.stats["spec_verified"] += 1
            for t in [*proposal.tokens[:accepted], token]:
                self.stats["spec_emitted"] += 1
                self._emit(request, t)
                if request not in self._running:
                    break

    @staticmethod
    def _draft_pick(logits: torch.Tensor, request: Request) -> tuple[int, torch.Tensor | None]:
        params = request.params
        if params.temperature == 0:
            return int(logits.argmax()), None
        probs = probabilities(logits, params.temperature, params.top_p)
        return int(torch.multinomial(probs, 1, generator=request.generator)), probs

    def _emit(self, request: Request, token: int) -> None:
        request.output.append(token)
        self.stats["generated_tokens"] += 1
        if token in request.stop_ids or request.cancelled:
            self._finish(request, "stop")
            return
        request.on_token(token)
        if len(request.output) >= request.params.max_tokens:
            self._finish(request, "length")

    def _abandon(self, requests: list[Request]) -> None:
        """The engine is stopping: every request still open ends with an error, so that no caller
        waits forever (a caller already gone, e.g. a closed event loop, is only logged)."""
        self._running.clear()
        for request in requests:
            try:
                request.on_done("error: the engine stopped")
            except Exception:
                log.debug("a stopped request's caller is gone", exc_info=True)

    def _finish(self, request: Request, reason: str) -> None:
        if request in self._running:
            self._running.remove(request)
        heapq.heappush(self._free, request.slot)
        request.on_done(reason)

    @staticmethod
    def _sample(logits: torch.Tensor, request: Request) -> int:
        params = request.params
        if params.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(probabilities(logits, params.temperature, params.top_p), 1,
                                     generator=request.generator))
