"""Speculative decoding. Each step, a draft proposes K tokens for every running request; the main
model verifies all of them in one batched forward over K+1 positions per row; each row keeps the
longest accepted prefix of its proposals plus one token of the main model's own (the correction,
or a bonus when all K were accepted), so every step emits 1..K+1 tokens for one main forward.

Acceptance follows the standard rule (Leviathan et al., Chen et al.): greedy rows accept a proposal
while it equals the main model's argmax, so their output is exactly plain greedy decoding; sampled
rows accept proposal d with probability min(1, p(d) / q(d)) and, at the first rejection, sample
from the normalised residual max(0, p - q), so their tokens follow the main model's distribution
(p, q: the main and draft distributions after temperature and top-p).

The caches need no copying back: a rejected position is simply not counted, and the next forward
overwrites it. Two drafts:
- `ModelDraft`: a separate, smaller checkpoint with the same vocabulary, with its own KV cache.
- `MTPDraft` (worker/mtp.py): the checkpoint's own MTP layer, fed the main model's hidden states.
"""

import dataclasses
import logging

import numpy
import torch

from worker.model import CausalLM
from worker.mtp import MTPDraft

log = logging.getLogger(__name__)


def greedy(logits: torch.Tensor) -> int | list[int]:
    """The argmax of CPU float32 logits, one row ([V]: an int) or each of several ([N, V]: a list):
    the first largest, a NaN before any number, as torch.argmax picks. Through numpy: torch's
    argmax over a 49,152-token row takes 67 us on a 2-core Zen 2, numpy's 7 (8 rows: 265 against
    36 us), and a greedy decode step there is ~9 ms."""
    return logits.numpy().argmax(-1).tolist()


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution over the vocabulary (logits: [V] finite, temperature > 0). The
    largest logit is subtracted before dividing, so that a small temperature cannot overflow."""
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        keep[0] = True  # the top token, whatever top_p (one below float32's least, 1e-46, compared as 0)
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    return probs


@dataclasses.dataclass(slots=True)
class Proposal:
    tokens: list[int]
    probs: list[torch.Tensor | None]
    """The draft's distribution each token was drawn from (None for greedy rows)."""


class ModelDraft:
    """A separate draft model. Per slot, `valid[slot]` positions of its cache hold keys and values of
    tokens the request really has; proposing first feeds it the ones it has not seen."""

    kind = "draft"

    def __init__(self, model: CausalLM, num_slots: int, max_len: int):
        self.model = model
        self.cache = model.new_cache(num_slots, max_len)
        self.valid = [0] * num_slots

    def prefilled(self, slot: int, prompt: list[int], states: torch.Tensor | None) -> None:
        self.valid[slot] = 0

    def propose(self, slot: int, tokens: list[int], k: int, pick) -> Proposal:
        """`tokens`: the request's prompt and output so far; `pick(logits)` -> (token, probs)."""
        n, start = len(tokens), self.valid[slot]
        ids = torch.tensor([tokens[start:n]])
        logits = self.model.forward(ids, torch.arange(start, n)[None], self.cache, torch.tensor([slot]))
        out = Proposal([], [])
        for i in range(k):
            token, probs = pick(logits[0])
            out.tokens.append(token)
            out.probs.append(probs)
            if i + 1 < k:
                logits = self.model.forward(torch.tensor([[token]]), torch.tensor([[n + i]]), self.cache,
                                            torch.tensor([slot]))
        return out  # the cache now holds positions 0..n+k-2 (the last proposal was never fed)

    def verified(self, slot: int, n: int, k: int, accepted: int, states: torch.Tensor | None) -> None:
        """`n`: the request's length before this step; `accepted` of the k proposals were kept."""
        self.valid[slot] = min(n + accepted, n + k - 1)


class MTPDraftRunner:
    """The MTP layer as a draft. It predicts the token at t+2 from the main model's state at t and
    the token at t+1, so per slot it keeps the main model's states it has not consumed yet (from the
    prefill, then from each verification's accepted positions)."""

    kind = "mtp"

    def __init__(self, model: MTPDraft, num_slots: int, max_len: int):
        self.model = model
        self.cache = model.new_cache(num_slots, max_len)
        self.pending: list[torch.Tensor | None] = [None] * num_slots
        self.start = [0] * num_slots
        """Position t of the first pending state."""

    def prefilled(self, slot: int, prompt: list[int], states: torch.Tensor | None) -> None:
        self.pending[slot], self.start[slot] = states, 0

    def propose(self, slot: int, tokens: list[int], k: int, pick) -> Proposal:
        n, start, states = len(tokens), self.start[slot], self.pending[slot]
        ids = torch.tensor([tokens[start + 1:n]])  # the token after each pending state
        logits, out_states = self.model.step(ids, states[None], torch.arange(start + 1, n)[None], self.cache,
                                             torch.tensor([slot]))
        logits, state = logits[0, -1], out_states[:, -1:]
        proposal = Proposal([], [])
        for i in range(k):
            token, probs = pick(logits)
            proposal.tokens.append(token)
            proposal.probs.append(probs)
            if i + 1 < k:  # chain: this layer's own state and the token it just proposed
                logits, state = self.model.step(torch.tensor([[token]]), state, torch.tensor([[n + i]]), self.cache,
                                                torch.tensor([slot]))
                logits = logits[0, -1]
        return proposal

    def verified(self, slot: int, n: int, k: int, accepted: int, states: torch.Tensor | None) -> None:
        """`states`: the main model's states at positions n-1 .. n-1+k of this step's verification."""
        self.pending[slot], self.start[slot] = states[:accepted + 1], n - 1


@dataclasses.dataclass(slots=True)
class Speculator:
    """What an engine speculates with: a draft model (a separate CausalLM, or the MTP layer) and K."""

    model: CausalLM
    """The draft (at TP > 1, rank 0's parallel.LeaderDraft over it)."""
    k: int
    kind: str = ""
    """"mtp" or "draft"; by default from the model's class."""

    def __post_init__(self) -> None:
        self.kind = self.kind or ("mtp" if isinstance(self.model, MTPDraft) else "draft")

    def runner(self, num_slots: int, max_len: int) -> ModelDraft | MTPDraftRunner:
        """The draft's per-slot state and cache, for an engine of `num_slots` slots."""
        return (MTPDraftRunner if self.kind == "mtp" else ModelDraft)(self.model, num_slots, max_len)

    def verify(self, draft, model, cache, batch: list) -> tuple[list[Proposal], list[int], torch.Tensor,
                                                               torch.Tensor | None]:
        """One step's proposals and their verification: the draft (`runner`'s) proposes K tokens
        after each request of `batch` (worker.requests.Request, in slot order), and the main model
        scores every row's last token and proposals in one forward over K+1 positions. Returns (the
        proposals, each request's length before the step, the logits [B, K+1, V], and for an MTP
        draft the main model's states [B, K+1, H], else None)."""
        k, mtp = self.k, self.kind == "mtp"
        proposals, lengths = [], []
        for r in batch:
            tokens = r.prompt + r.output
            lengths.append(len(tokens))
            proposals.append(draft.propose(r.slot, tokens, k, lambda logits, r=r: draft_pick(logits, r.params,
                                                                                              r.generator)))
        ids = torch.tensor([[r.output[-1], *p.tokens] for r, p in zip(batch, proposals)])
        positions = torch.tensor([[n - 1 + i for i in range(k + 1)] for n in lengths])
        slots = torch.tensor([r.slot for r in batch])
        out = model.forward(ids, positions, cache, slots, all_logits=True, hidden=mtp)
        logits, states = out if mtp else (out, None)
        return proposals, lengths, logits, states

    def figures(self, stats: dict) -> dict:
        """Acceptance rate, mean accepted length and tokens per main forward, per sequence (a step
        verifies every running sequence in one forward), from an engine's counters so far."""
        verified = max(stats["spec_verified"], 1)
        return {"kind": self.kind, "num_speculative_tokens": self.k,
                "proposed": stats["spec_proposed"], "accepted": stats["spec_accepted"],
                "acceptance_rate": stats["spec_accepted"] / max(stats["spec_proposed"], 1),
                "mean_accepted_length": stats["spec_accepted"] / verified,
                "tokens_per_main_forward": stats["spec_emitted"] / verified}


def draft_pick(logits: torch.Tensor, params, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """The draft's token for a request sampled with `params` (worker.requests.SamplingParams), and
    the distribution it was drawn from (None when greedy), which acceptance weighs it by."""
    if not numpy.isfinite(logits.numpy()).all():
        logits = _broken_draft(logits)
    if params.temperature == 0:
        return greedy(logits), None
    probs = probabilities(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def _broken_draft(logits: torch.Tensor) -> torch.Tensor:
    """Even logits in place of a draft's NaN or infinite ones (NaN weights): its proposals are then
    uniform guesses, which acceptance weighs as such, so every request still gets the main model's
    tokens and distribution, where sampling from the NaNs failed the whole batch."""
    global _warned
    if not _warned:
        log.warning("the draft's logits hold NaN or infinity (its weights do?): its proposals are uniform "
                    "guesses, which the main model mostly rejects; check the draft's checkpoint")
        _warned = True
    return torch.zeros_like(logits)


_warned = False


def accept(logits: torch.Tensor, proposal: Proposal, temperature: float, top_p: float,
           generator: torch.Generator | None) -> tuple[int, int]:
    """(how many proposals to keep, the main model's next token) for one row; logits: [K+1, V]."""
    k = len(proposal.tokens)
    if temperature == 0:
        best = greedy(logits[:k + 1])
        accepted = 0
        while accepted < k and proposal.tokens[accepted] == best[accepted]:
            accepted += 1
        return accepted, best[accepted]
    for i, (token, q) in enumerate(zip(proposal.tokens, proposal.probs)):
        p = probabilities(logits[i], temperature, top_p)
        if torch.rand((), generator=generator) * q[token] < p[token]:  # u < p/q without dividing by 0
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(probabilities(logits[k], temperature, top_p), 1, generator=generator))
