"""The generation engine: one scheduler thread runs prefill for new requests and batched decode for
all running ones over a static per-slot KV cache. Requests arrive from any thread; their tokens go
back through a callback as they are produced."""

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
from worker.requests import Request, Result, SamplingParams, check_request
from worker.sampling import Pick, all_finite, check_finite, describe, needs_work, prompt_logprobs, seeded
from worker.speculative import Speculator, accept, greedy

log = logging.getLogger(__name__)
_WAKE = object()
"""Queued by pause() so that a scheduler waiting for requests looks at its pause flag."""
PREFILL_CHUNK = 256
"""Prompt tokens a step prefills of a long prompt that arrives while others decode; a decode step of
the others runs between its parts, so their streams pause for one part, not for the whole prompt
(`preload bench prefill`)."""


def _prefill_key(request: Request) -> tuple[int, bool]:
    return len(request.prompt), request.params.prompt_logprobs is not None


class Engine:
    def __init__(self, model: CausalLM, max_batch: int = 8, max_len: int = 2048,
                 speculator: Speculator | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 eos_token_ids: tuple[int, ...] = ()):
        """With a `speculator`, its draft proposes tokens that one main forward per step verifies
        (worker/speculative.py); the caches get room for the K positions a step may look ahead.
        A prompt longer than `prefill_chunk` that arrives while others decode is prefilled that
        many tokens at a time, between their steps (0: always whole). A request stops at the
        config's eos tokens and at `eos_token_ids` (generation_config.json's) unless it ignores them."""
        self.model = model
        self.eos = frozenset(model.spec.eos_token_ids) | frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.max_len = model.spec.context_len(max_len)
        self.speculator = speculator
        ahead = speculator.k if speculator else 0
        self.cache = model.new_cache(max_batch, self.max_len + ahead)
        self.draft = speculator.runner(max_batch, self.max_len + ahead) if speculator else None
        self._pending: queue.Queue[Request | None] = queue.Queue()
        self._free = list(range(max_batch))
        """A heap: a new request takes the lowest free slot, so running requests tend to hold
        consecutive slots, whose caches a batched step reads as one view (worker/kv_cache.py)."""
        self._running: list[Request] = []
        self._held: list[Request] = []
        """Taken from the queue, waiting for enough free slots for all its choices (n > 1)."""
        self._filling: list[Request] = []
        """Holding slots, prefilled in parts (_fill), oldest first; then they run."""
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._pause, self._parked, self._resume = threading.Event(), threading.Event(), threading.Event()
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0, "prefill_parts": 0}
        if speculator is not None:
            self.stats.update(spec_proposed=0, spec_accepted=0, spec_verified=0, spec_emitted=0)

    def speculation(self) -> dict:
        """Speculative decoding's figures so far (Speculator.figures); {} without it."""
        return self.speculator.figures(self.stats) if self.speculator is not None else {}

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._pending.put(None)
        self.resume()
        self._thread.join()

    def pause(self, timeout: float) -> bool:
        """Parks the scheduler thread once the requests it runs have finished. Requests still queued
        then end with an error (their callers are gone: the HTTP server has closed first); new ones
        wait in the queue until resume(). True once parked; False if they did not finish in `timeout`."""
        self._resume.clear()
        self._pause.set()
        self._pending.put(_WAKE)
        return self._parked.wait(timeout)

    @property
    def parked(self) -> bool:
        return self._parked.is_set()

    def resume(self) -> None:
        self._pause.clear()
        self._parked.clear()
        self._resume.set()

    def caches(self) -> list:
        """The KV caches this engine owns (the main model's, and its draft's)."""
        return [self.cache] + ([self.draft.cache] if self.draft is not None else [])

    def generate_parked(self, prompt: list[int], params: SamplingParams) -> Result:
        """One request run to its end in the calling thread, alone, on the scheduler's own path
        (prefill, then batch-of-one steps), while the scheduler is parked (pause())."""
        if not self._parked.is_set():
            raise RuntimeError("generate_parked needs the scheduler parked (Engine.pause)")
        tokens, reason = [], []
        start = time.perf_counter()
        request = self.submit(prompt, params, tokens.append, reason.append, enqueue=False)
        self._prefill([request])
        while request in self._running:
            self._decode()
        if reason[0].startswith("error"):
            raise RuntimeError(reason[0])
        return Result(tokens, reason[0], time.perf_counter() - start, request.picks)

    def submit(self, prompt: list[int], params: SamplingParams, on_token: Callable[[int], None],
               on_done: Callable[[str], None], enqueue: bool = True) -> Request:
        self.check(prompt, params)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        generator = seeded(params.seed)
        request = Request(prompt, params, on_token, on_done, generator, stop_ids=frozenset(stop))
        if enqueue:
            self._pending.put(request)
        return request

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError (what is wrong and what to change) for a request this engine
        cannot run; submit() checks too, this lets a caller check every prompt before the first runs."""
        check_request(prompt, params, self.max_len, self.model.spec.vocab_size, self.speculator is not None)

    def submit_choices(self, prompt: list[int], params: list[SamplingParams], on_token: list[Callable[[int], None]],
                       on_done: list[Callable[[str], None]]) -> list[Request]:
        """n choices for one prompt, one request each (params[i] may carry its own seed). Without
        speculation they share one prefill: the first request's cache is copied for the others."""
        if len(params) > self.cache.num_slots:
            raise InvalidRequestError(f"n={len(params)} choices need as many cache slots; this engine has "
                                      f"{self.cache.num_slots} (--max-batch)")
        requests = [self.submit(prompt, p, t, d, enqueue=False) for p, t, d in zip(params, on_token, on_done)]
        if self.speculator is not None:  # each choice keeps its own draft state: prefill each
            for request in requests:
                self._pending.put(request)
        else:
            requests[0].siblings = requests[1:]
            self._pending.put(requests[0])
        return requests

    def generate(self, prompt: list[int], params: SamplingParams) -> Result:
        """Blocking convenience: all tokens of one request."""
        tokens, reason, done, start = [], [], threading.Event(), time.perf_counter()
        request = self.submit(prompt, params, tokens.append, lambda r: (reason.append(r), done.set()))
        while not done.wait(0.5):  # a timeout, so that a Ctrl-C the kernel gave another thread is seen
            pass
        if reason[0].startswith("error"):
            raise RuntimeError(reason[0])
        return Result(tokens, reason[0], time.perf_counter() - start, request.picks)

    def _loop(self) -> None:
        while True:
            if self._pause.is_set() and not self._running and not self._filling:
                if not self._orphans():
                    return
                self._parked.set()
                self._resume.wait()
                continue
            block = not self._running and not self._filling
            arrived, slots = [], len(self._free)
            while self._held:  # n > 1 waiting for slots, in order; one cancelled meanwhile goes
                if not self._dropped(held := self._held[0]):
                    if 1 + len(held.siblings) > slots:
                        break
                    arrived.append(held)
                    slots -= 1 + len(held.siblings)
                self._held.pop(0)
            while slots and not self._held and not self._pause.is_set():
                try:
                    request = self._pending.get(block=block)
                except queue.Empty:
                    break
                if request is _WAKE:
                    continue
                if request is None:  # stopping: what arrived with it, and what runs, ends here
                    self._abandon(self._held + arrived)  # and, as always, what runs
                    return
                block = False
                if self._dropped(request):
                    continue
                if 1 + len(request.siblings) > slots:  # n > 1: waits for as many free slots
                    self._held.append(request)
                    break
                arrived.append(request)
                slots -= 1 + len(request.siblings)
            # Prompts of one length prefill together: one forward reads the weights once for all.
            # Echoed ones (every position's logits: [T, V] floats) go one at a time. Long ones go in
            # parts if others were decoding before they arrived (not if those arrived with them).
            busy = bool(self._running or self._filling)
            for (_, echo), group in itertools.groupby(sorted(arrived, key=_prefill_key), _prefill_key):
                for part in ([r] for r in group) if echo else [list(group)]:
                    self._prefill(part, busy)
            if self._filling:
                self._fill()
            if self._running:
                self._decode()

    def _prefill(self, requests: list[Request], busy: bool = False) -> None:
        """Gives the requests' choices their slots, then prefills them now, or in parts (_fill) if
        their prompts are long and others are `busy` decoding. Echoed ones (every position's
        logits) go whole."""
        for request in requests:
            for r in (request, *request.siblings):
                r.slot = heapq.heappop(self._free)
                self.stats["requests"] += 1
        if (busy and 0 < self.prefill_chunk < len(requests[0].prompt)
                and all(r.params.prompt_logprobs is None for r in requests)):
            self._filling.extend(requests)
        else:
            self._forward_prompts(requests, len(requests[0].prompt))

    def _fill(self) -> None:
        """The next part of the oldest prompt prefilled in parts; all the rest of it once nothing
        else runs (no stream waits on it). One whose client has gone ends here."""
        request = self._filling[0]
        if all(r.cancelled for r in (request, *request.siblings)):
            self._filling.pop(0)
            for r in (request, *request.siblings):
                self._finish(r, "stop")
            return
        length, chunk = len(request.prompt), self.prefill_chunk if self._running else 0
        end = min(request.filled + chunk, length) if chunk > 0 else length
        self.stats["prefill_parts"] += 1
        if end == length:
            self._filling.pop(0)
        self._forward_prompts([request], end)

    def _forward_prompts(self, requests: list[Request], end: int) -> None:
        """Prefills the requests' prompts (all of one length) from where they are (Request.filled)
        up to `end`; once a prompt is in, its choices run, each with its first token."""
        start, length = requests[0].filled, len(requests[0].prompt)
        echo = any(r.params.prompt_logprobs is not None for r in requests)
        try:
            ids = torch.tensor([r.prompt[start:end] for r in requests])
            positions = torch.arange(start, end).expand(len(requests), -1)
            slots = torch.tensor([r.slot for r in requests])
            # echo: every position's logits (the prompt's log-probabilities); an MTP draft: the states
            mtp = self.speculator is not None and self.speculator.kind == "mtp"
            out = self.model.forward(ids, positions, self.cache, slots, all_logits=echo, hidden=mtp)
            logits, states = out if mtp else (out, None)
            self.stats["prompt_tokens"] += (end - start) * len(requests)
            for row, request in enumerate(requests):
                request.filled = end
                if states is not None:
                    request.states.append(states[row])
            if end < length:
                return
            if echo:
                for row, r in enumerate(requests):
                    if r.params.prompt_logprobs is not None:
                        r.prompt_picks = prompt_logprobs(logits[row], r.prompt, r.params.prompt_logprobs)
                logits = logits[:, -1]
            for request in requests:
                if self.draft is not None:
                    parts, request.states = request.states, []
                    joined = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
                    self.draft.prefilled(request.slot, request.prompt, joined)
                if request.siblings:  # n > 1: one prefill, its keys and values copied
                    self.model.copy_cache(self.cache, request.slot, [s.slot for s in request.siblings], length)
        except Exception as e:
            log.exception("prefill failed")
            for request in requests:
                if request in self._filling:
                    self._filling.remove(request)
                for r in (request, *request.siblings):
                    self._finish(r, f"error: {e}")
            return
        for row, request in enumerate(requests):
            for r in (request, *request.siblings):
                r.prompt_picks = request.prompt_picks
                self._running.append(r)
                if (picked := self._guarded(r, lambda: r.pick_next(logits[row]))) is not None:
                    self._emit(r, picked)

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
        best, finite = greedy(logits), all_finite(logits)  # a row of NaN: pick() says so
        for row, request in enumerate(batch):
            if finite[row] and not needs_work(request.params):
                self._emit(request, Pick(best[row]))
            elif (picked := self._guarded(request, lambda: request.pick_next(logits[row]))) is not None:
                self._emit(request, picked)

    def _speculate(self) -> None:
        """One speculative step for every running request: propose, verify in one forward, keep the
        accepted prefix and the main model's next token."""
        batch, draft, k = sorted(self._running, key=lambda r: r.slot), self.draft, self.speculator.k
        try:
            proposals, lengths, logits, states = self.speculator.verify(draft, self.model, self.cache, batch)
        except Exception as e:
            log.exception("speculative decode failed")
            for r in batch:
                self._finish(r, f"error: {e}")
            return
        self.stats["decode_steps"] += 1
        for row, (request, proposal, n) in enumerate(zip(batch, proposals, lengths)):
            params = request.params
            if (chosen := self._guarded(request, lambda: accept(check_finite(logits[row]), proposal, params.temperature,
                                                                params.top_p, request.generator))) is None:
                continue
            accepted, token = chosen
            draft.verified(request.slot, n, k, accepted, states[row] if states is not None else None)
            for key, count in (("spec_proposed", k), ("spec_accepted", accepted), ("spec_verified", 1)):
                self.stats[key] += count
            for i, t in enumerate([*proposal.tokens[:accepted], token]):
                self.stats["spec_emitted"] += 1  # log-probabilities: the main model's
                if (picked := self._guarded(request, lambda: describe(t, logits[row][i], params, request.prompt,
                                                                      request.output))) is not None:
                    self._emit(request, picked)
                if request not in self._running:
                    break

    def _emit(self, request: Request, picked: Pick) -> None:
        token = picked.token
        request.output.append(token)
        if request.params.logprobs is not None:
            request.picks.append(picked)
        self.stats["generated_tokens"] += 1
        if token in request.stop_ids or request.cancelled:
            self._finish(request, "stop")
            return
        request.notify(request.on_token, token)
        if len(request.output) >= request.params.max_tokens:
            self._finish(request, "length")

    def _dropped(self, request: Request) -> bool:
        """A queued request whose caller cancelled every choice of it (the client went away) ends
        here, unprefilled: 3,000 prompts of a client gone were prefilled one by one before."""
        if not all(r.cancelled for r in (request, *request.siblings)):
            return False
        for r in (request, *request.siblings):
            r.notify(r.on_done, "stop")
        return True

    def _orphans(self) -> bool:
        """Parking: the HTTP server has closed, so requests still queued or held have nobody
        waiting; they end with an error rather than outlive the quiet point. False if the engine
        is stopping (stop() came while it parked)."""
        waiting, stopping = self._held, False
        self._held = []
        while True:
            try:
                request = self._pending.get_nowait()
            except queue.Empty:
                break
            if request is None:
                stopping = True
            elif request is not _WAKE:
                waiting.append(request)
        self._abandon(waiting, "error: the engine paused for a snapshot")
        return not stopping

    def _abandon(self, requests: list[Request], reason: str = "error: the engine stopped") -> None:
        """Every request given, and every choice of theirs, ends with `reason`, so that no caller
        waits forever. Running and part-prefilled ones are dropped too: the engine is stopping or
        parking."""
        ended = {id(r): r for r in self._running}
        self._running.clear()
        for request in [*self._filling, *requests]:  # siblings run too: each is notified once
            ended.update((id(s), s) for s in (request, *request.siblings))
        self._filling.clear()
        for request in ended.values():
            request.notify(request.on_done, reason)

    def _finish(self, request: Request, reason: str) -> None:
        if request in self._running:
            self._running.remove(request)
        heapq.heappush(self._free, request.slot)
        request.notify(request.on_done, reason)

    def _guarded(self, request: Request, choose: Callable):
        """choose(), the request's next token; None if that fails (NaN logits): the request then
        ends with the error, and the scheduler goes on with everyone else's."""
        try:
            return choose()
        except Exception as e:
            log.warning("cannot choose the next token of a request (%s: %s); ending it", type(e).__name__, e)
            self._finish(request, f"error: cannot choose the next token: {e}")
            return None
