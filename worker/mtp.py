"""The draft model of multi-token prediction: a checkpoint's own MTP layer run on the main model's
hidden states (worker/speculative.py drives it)."""

from collections.abc import Mapping

import torch

from kernels.norm import rms_norm
from preload_daemon.arch import ArchSpec
from preload_daemon.errors import CheckpointError
from worker.kv_cache import KVCache
from worker.model import CausalLM, SingleRank, Weight


class MTPDraft(CausalLM):
    """A DeepSeek-V3-style multi-token-prediction layer used as a draft. From the main model's hidden
    state at position t (before its final norm) and the token at t+1 it predicts the token at t+2:
    eh_proj([enorm(embed(token)); hnorm(hidden)]) -> one decoder layer -> shared_head.norm -> lm_head.
    Chained for more tokens by feeding its own output state back. The embedding and lm_head are the
    main model's (the daemon shares them by reference); the decoder layer runs at the token's
    position with its own one-layer KV cache."""

    def __init__(self, spec: ArchSpec, weights: Mapping[str, Weight], tp=None):
        if spec.num_mtp_layers < 1:
            raise CheckpointError(f"{spec.source}: num_nextn_predict_layers is 0: this model has no MTP layer; "
                                  "use --speculative draft --draft-model DIR instead")
        self.spec = spec
        self.tp = tp or SingleRank()
        first = spec.num_layers
        names = [spec.name(k, first) for k in ("enorm", "hnorm", "eh_proj", "head_norm")]
        missing = [n for n in [*names, spec.name("embed")] if n not in weights]
        if missing:
            raise CheckpointError(f"the MTP draft lacks {', '.join(missing[:3])}; load the checkpoint's draft "
                                  "component (and its main one)")
        self.enorm, self.hnorm, self.eh_proj, self.head_norm = (weights[n] for n in names)
        self._common(spec, weights)
        self.layers = [self._layer(weights, first)]

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [B, T] (the tokens at t+1 and their positions); states: [B, T, H]
        (hidden states at t). Returns float32 logits for the tokens at t+2 ([B, T, V]) and this
        layer's output states ([B, T, H]), which chain into the next step."""
        eps = self.spec.rms_norm_eps
        batch, t = input_ids.shape
        step = self._step(positions, slots, cache)
        e = rms_norm(self._embed(input_ids.reshape(-1).to(self.device)), self.enorm, eps)
        x = self.linear(torch.cat([e, rms_norm(states.reshape(batch * t, -1).to(self.dtype), self.hnorm, eps)], dim=-1),
                        self.eh_proj, None, step.exact)
        x = self._decoder_layer(self.layers[0], x, step, cache.layers[0], 0)
        return self._logits(rms_norm(x, self.head_norm, eps), step.exact).view(batch, t, -1), x.view(batch, t, -1)
