"""What a caller asks the engine for and gets back: the sampling parameters of a request (checked
as they are made), the request as the scheduler tracks it, and the result of a blocking generate."""

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from preload_daemon.errors import InvalidRequestError
from worker.sampling import MAX_TOP_LOGPROBS, Pick, pick

log = logging.getLogger(__name__)


GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (as vLLM's): dividing logits by less overflows."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy (and so is anything below GREEDY_BELOW)."""
    top_p: float = 1.0
    seed: int | None = None
    """With temperature > 0, the same seed gives the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Added to the model's end-of-sequence tokens."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Also record each generated token's log-probabilities (worker/sampling.Pick), with this many
    most likely alternatives (0: none); None records nothing."""
    prompt_logprobs: int | None = None
    """Also record each prompt token's log-probability given the ones before it (echo)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):  # JSON's NaN and Infinity parse as floats
                raise InvalidRequestError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:  # logits / 1e-40 overflow to inf; as vLLM, this is greedy
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")


ECHO_LOGITS_BYTES = 1 << 30
"""The prompt's log-probabilities need the logits of every prompt position: at most this many bytes."""


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
    picks: list[Pick] = dataclasses.field(default_factory=list)
    """With params.logprobs: each generated token's log-probabilities (worker/sampling.Pick)."""
    prompt_picks: list[Pick | None] = dataclasses.field(default_factory=list)
    """With params.prompt_logprobs: each prompt token's (None for the first)."""
    siblings: list["Request"] = dataclasses.field(default_factory=list)
    """More choices of the same prompt (n > 1): prefilled once, by this request, then their caches
    are copies of this one's and each samples on its own."""
    filled: int = 0
    """Prompt tokens in the cache so far: a long prompt that arrives while others decode is
    prefilled in parts (Engine.prefill_chunk)."""
    states: list = dataclasses.field(default_factory=list)
    """With an MTP draft, the main model's states of the parts prefilled so far."""

    def notify(self, callback: Callable, value) -> None:
        """One of its caller's callbacks. One that raises (its event loop is gone) cancels this
        request, never the scheduler that runs everyone else's."""
        try:
            callback(value)
        except Exception as e:
            self.cancelled = True
            log.warning("a request's caller failed (%s: %s); cancelling that request", type(e).__name__, e)

    def pick_next(self, logits: torch.Tensor) -> Pick:
        """Its next token from the model's logits, as its sampling parameters say."""
        return pick(logits, self.params, self.prompt, self.output, self.generator)


@dataclasses.dataclass(slots=True)
class Result:
    tokens: list[int]
    finish_reason: str
    seconds: float
    picks: list[Pick] = dataclasses.field(default_factory=list)
    """With params.logprobs: each token's log-probabilities (worker/sampling.Pick)."""

    @property
    def logprobs(self) -> list[float]:
        return [p.raw for p in self.picks]


def check_request(prompt: list[int], params: SamplingParams, max_len: int, vocab: int, speculative: bool) -> None:
    """Raises InvalidRequestError, saying what is wrong and what to change, for a request an engine
    of `max_len` positions and a vocabulary of `vocab` (speculating or not) cannot run."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    if len(prompt) >= max_len:  # said apart: a chat without max_tokens asks for what fits, here 1
        raise InvalidRequestError(f"the prompt ({len(prompt)} tokens) leaves no room in the engine's max length "
                                  f"{max_len} for a token of the answer; shorten it")
    if len(prompt) + params.max_tokens > max_len:
        raise InvalidRequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                  f"engine's max length {max_len}; shorten one of them")
    if speculative and (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1):
        raise InvalidRequestError("presence, frequency and repetition penalties are not supported with "
                                  "speculative decoding (its verification samples the model's own distribution)")
    for name, ids in (("prompt token ids", prompt), ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{name} must be in [0, {vocab}): no other token exists")
    if params.prompt_logprobs is not None and len(prompt) * vocab * 4 > ECHO_LOGITS_BYTES:
        raise InvalidRequestError(
            f"the prompt's log-probabilities (echo with logprobs) are limited to {ECHO_LOGITS_BYTES // (vocab * 4)} "
            f"prompt tokens with this model's vocabulary of {vocab}; this prompt has {len(prompt)}: shorten it")
