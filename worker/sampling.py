"""Choosing the next token from one row of logits: penalties, temperature, top-p, and the
log-probabilities a caller asked for (the model's raw ones, the sampling distribution's, top-k).

Penalties follow vLLM's (and OpenAI's) definitions: presence and frequency penalties count the
tokens generated so far; the repetition penalty (Hugging Face's) covers prompt and output.
"""

import dataclasses

import numpy
import torch

from worker.speculative import greedy, probabilities

MAX_TOP_LOGPROBS = 20
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(slots=True)
class Pick:
    token: int
    raw: float | None = None
    """log_softmax of the model's logits at the token (with logprobs asked for)."""
    sampled: float | None = None
    """Its log-probability under the distribution it was drawn from: penalties, temperature and
    top-p applied; 0 for a greedy choice, which is certain."""
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """The `logprobs` most likely tokens under the raw logits, most likely first."""


def needs_work(params) -> bool:
    """Whether a row must go through pick() (else a batch's argmax does for greedy rows)."""
    return (params.temperature > 0 or params.logprobs is not None or params.presence_penalty != 0
            or params.frequency_penalty != 0 or params.repetition_penalty != 1)


def penalized(logits: torch.Tensor, params, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float32 logits with the request's penalties applied (a new tensor when any applies)."""
    x = logits.float()
    if params.repetition_penalty != 1 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)))
        values = x[seen]
        x = x.clone()
        x[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        x.clamp_(-FLOAT32_MAX, FLOAT32_MAX)  # a penalty near 0 or 10 pushes logits past float32's range
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output).unique(return_counts=True)
        x = x.clone() if x is logits else x
        x[ids] -= params.presence_penalty + params.frequency_penalty * counts.float()
    return x


def all_finite(logits: torch.Tensor) -> list[bool]:
    """Whether each row of CPU float32 logits ([N, V]) holds no NaN or infinity. Through numpy, as
    greedy(): 35 us for 8 rows of 49,152 on a 2-core Zen 4, torch's isfinite().all() 385 us."""
    return numpy.isfinite(logits.numpy()).all(-1).tolist()


def check_finite(x: torch.Tensor) -> torch.Tensor:
    """x, if it holds no NaN or infinity: sampling from such logits fails, and their log-probabilities
    are not JSON."""
    if not numpy.isfinite(x.numpy()).all():
        raise ValueError("the model's logits hold NaN or infinity: its weights do (check the checkpoint, e.g. "
                         "with torch.isfinite on each tensor), or a value overflowed its dtype")
    return x


def pick(logits: torch.Tensor, params, prompt: list[int], output: list[int],
         generator: torch.Generator | None) -> Pick:
    """The next token for one row of logits ([V]), with the log-probabilities `params` asks for."""
    x = check_finite(penalized(logits, params, prompt, output))
    if params.temperature == 0:
        token, probs = greedy(x), None
    else:
        probs = probabilities(x, params.temperature, params.top_p)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return describe(token, logits, params, prompt, output, probs)


def describe(token: int, logits: torch.Tensor, params, prompt: list[int], output: list[int],
             probs: torch.Tensor | None = None) -> Pick:
    """`token`'s Pick for one row of logits (a token chosen elsewhere: speculative verification),
    with the log-probabilities `params` asks for; `probs`: the sampling distribution if known."""
    result = Pick(token)
    if params.logprobs is None:
        return result
    raw = torch.log_softmax(logits.float(), -1)
    if params.temperature == 0:
        sampled = 0.0
    else:
        if probs is None:
            probs = probabilities(penalized(logits, params, prompt, output), params.temperature, params.top_p)
        sampled = float(torch.log(probs[token]))
    result.raw, result.sampled = float(raw[token]), sampled
    if params.logprobs:
        values, ids = raw.topk(params.logprobs)
        result.top = list(zip(ids.tolist(), values.tolist()))
    return result


PROMPT_CHUNK = 256


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> list[Pick | None]:
    """Each prompt token's raw log-probability given the ones before it (none for the first), with
    the top `k` at each position; logits: [T, V] of the prompt's positions."""
    out: list[Pick | None] = [None]
    following = torch.tensor(prompt[1:])
    for start in range(0, len(prompt) - 1, PROMPT_CHUNK):  # a [chunk, V] float copy at a time
        chunk = check_finite(logits[start:start + PROMPT_CHUNK].float())
        raw = torch.log_softmax(chunk, -1)[:len(prompt) - 1 - start]
        chosen = raw.gather(1, following[start:start + len(raw), None])[:, 0].tolist()
        tops = raw.topk(k, dim=-1) if k else None
        for i, token in enumerate(prompt[start + 1:start + 1 + len(raw)]):
            top = list(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else []
            out.append(Pick(token, chosen[i], None, top))
    return out


U64 = (1 << 64) - 1


def seeded(seed: int | None) -> torch.Generator | None:
    """The generator a request with `seed` draws from (None: torch's global one). torch's CPU
    generator keeps 32 bits of its seed (7 and 7 + 2**32 drew alike, and 0 and -2**63), so the
    64-bit seed is mixed first (splitmix64's finalizer) and every bit of it counts: seeds that
    differ in their high bits alone no longer draw alike (two of the 2**64 still may, by chance)."""
    if seed is None:
        return None
    z = seed & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    z ^= z >> 31
    return torch.Generator().manual_seed((z ^ (z >> 32)) & 0xFFFFFFFF)
