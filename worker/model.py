"""Llama, Qwen2 and Qwen3 decoders built directly on the tensors a loader hands over: the model
keeps references to those tensors (views into a slab, or private memory) and never copies them."""

import dataclasses
import mmap
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kernels.activation import silu_mul
from kernels.attention import attention
from kernels.linear import linear
from kernels.norm import rms_norm
from kernels.quant import QuantizedWeight
from kernels.rope import apply_rope, cos_sin, inv_freq
from preload_daemon.arch import ArchSpec
from preload_daemon.errors import CheckpointError

Weight = torch.Tensor | QuantizedWeight  # the attention and MLP projections may be quantized


class SingleRank:
    """The tensor-parallel group of a model that is not split: rank 0 of 1, nothing to exchange."""

    rank, size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclasses.dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    post_norm: torch.Tensor
    gate: Weight
    up: Weight
    down: Weight
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class KVCache:
    """Static per-slot cache: [num_layers] x [slots, kv_heads, max_len, head_dim] for keys and values.
    It lives in one anonymous mapping, whose pages the kernel zero-fills on first touch: a large
    cache costs nothing at start-up, and unwritten positions read as zeros, never garbage."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_len: int,
                 dtype: torch.dtype):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        per_tensor = num_slots * num_kv_heads * max_len * head_dim
        self._mapping = mmap.mmap(-1, 2 * num_layers * per_tensor * dtype.itemsize)
        flat = torch.frombuffer(self._mapping, dtype=dtype)
        views = [flat[i * per_tensor:(i + 1) * per_tensor].view(shape) for i in range(2 * num_layers)]
        self.k, self.v = views[0::2], views[1::2]
        self.num_slots = num_slots
        self.max_len = max_len


class CausalLM:
    """The decoder of one tensor-parallel rank (all of it when `tp` is a SingleRank): its weights
    are this rank's shards as the load plan laid them out (kernels are unchanged), and the group
    exchanges partial sums after the row-parallel projections and the vocabulary-parallel
    embedding, and gathers the vocabulary-parallel logits."""

    def __init__(self, spec: ArchSpec, weights: Mapping[str, Weight], tp=None):
        self.spec = spec
        self.tp = tp or SingleRank()
        missing = [n for n in spec.required() if n not in weights]
        if missing:
            raise CheckpointError(f"the weights lack {len(missing)} tensor(s) the model needs, e.g. "
                                  f"{', '.join(missing[:3])}; refusing to build a model with uninitialised weights")
        self.num_heads, self.num_kv_heads = spec.local_heads(self.tp.size)
        self.embed = weights[spec.name("embed")]
        self.lm_head = weights.get(spec.name("lm_head"), self.embed) if spec.tie_word_embeddings \
            else weights[spec.name("lm_head")]
        self.vocab_start = self.tp.rank * self.embed.shape[0]
        self.norm = weights[spec.name("norm")]
        self.dtype = self.embed.dtype
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.inv_freq = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)

    @classmethod
    def from_config(cls, config: dict, weights: Mapping[str, Weight], tp=None) -> "CausalLM":
        """The model for a config.json document over `weights`."""
        return cls(ArchSpec.from_config(config), weights, tp)

    def _layer(self, w, i: int) -> Layer:
        def get(key: str):
            return w.get(self.spec.name(key, i))
        return Layer(input_norm=get("input_norm"), post_norm=get("post_norm"), q=get("q"), k=get("k"), v=get("v"),
                     o=get("o"), gate=get("gate"), up=get("up"), down=get("down"), q_bias=get("q_bias"),
                     k_bias=get("k_bias"), v_bias=get("v_bias"), o_bias=get("o_bias"), q_norm=get("q_norm"),
                     k_norm=get("k_norm"))

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.spec.num_layers, self.num_kv_heads, self.spec.head_dim, num_slots, max_len, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                all_logits: bool = False, hidden: bool = False):
        """input_ids, positions: [B, T]; slots: [B] cache slots. Writes the new keys and values into
        the cache and returns float32 logits for the last position of each row ([B, V]), or for every
        position ([B, T, V]) with all_logits; with `hidden`, (logits, the last layer's output before
        the final norm, [B, T, H]) for an MTP draft."""
        eps = self.spec.rms_norm_eps
        x = self._embed(input_ids)
        cos, sin = cos_sin(self.inv_freq, positions, self.dtype)
        length = int(positions.max()) + 1
        for i, layer in enumerate(self.layers):
            x = self._decoder_layer(layer, x, cos, sin, positions, cache, i, slots, length)
        states = x
        if not all_logits:
            x = x[:, -1]
        logits = self.tp.gather_last(F.linear(rms_norm(x, self.norm, eps), self.lm_head).float())
        return (logits, states) if hidden else logits

    def _decoder_layer(self, layer: Layer, x, cos, sin, positions, cache: KVCache, index: int, slots, length: int):
        eps = self.spec.rms_norm_eps
        h = rms_norm(x, layer.input_norm, eps)
        x = x + self._attention(layer, h, cos, sin, positions, cache, index, slots, length)
        h = rms_norm(x, layer.post_norm, eps)
        return x + self.tp.all_reduce(linear(silu_mul(linear(h, layer.gate), linear(h, layer.up)), layer.down))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        # This rank holds rows [vocab_start, vocab_start + local): look those up, zeros elsewhere, sum.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill(outside[..., None], 0)
        return self.tp.all_reduce(x)

    def _attention(self, layer: Layer, h, cos, sin, positions, cache: KVCache, index: int, slots, length: int):
        eps, head_dim = self.spec.rms_norm_eps, self.spec.head_dim
        batch, t, _ = h.shape
        q = linear(h, layer.q, layer.q_bias).view(batch, t, self.num_heads, head_dim)
        k = linear(h, layer.k, layer.k_bias).view(batch, t, self.num_kv_heads, head_dim)
        v = linear(h, layer.v, layer.v_bias).view(batch, t, self.num_kv_heads, head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, eps)
            k = rms_norm(k, layer.k_norm, eps)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        k_cache, v_cache = cache.k[index], cache.v[index]
        if batch == 1:
            start = int(positions[0, 0])
            k_cache[slots[0], :, start:start + t] = k[0]
            v_cache[slots[0], :, start:start + t] = v[0]
            keys, values = k_cache[slots[0], None, :, :length], v_cache[slots[0], None, :, :length]
        else:  # batched: each row's tokens at its own positions (decode, or speculative verification)
            k_cache[slots[:, None], :, positions] = k.transpose(1, 2)
            v_cache[slots[:, None], :, positions] = v.transpose(1, 2)
            keys, values = k_cache[slots, :, :length], v_cache[slots, :, :length]
        out = attention(q, keys, values, positions)
        out = self.tp.all_reduce(linear(out.transpose(1, 2).reshape(batch, t, self.num_heads * head_dim), layer.o))
        return out + layer.o_bias if layer.o_bias is not None else out


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
        self.num_heads, self.num_kv_heads = spec.local_heads(self.tp.size)
        self.embed = weights[spec.name("embed")]
        self.lm_head = weights.get(spec.name("lm_head"), self.embed) if spec.tie_word_embeddings \
            else weights[spec.name("lm_head")]
        self.vocab_start = self.tp.rank * self.embed.shape[0]
        self.dtype = self.embed.dtype
        self.layers = [self._layer(weights, first)]
        self.inv_freq = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(1, self.num_kv_heads, self.spec.head_dim, num_slots, max_len, self.dtype)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [B, T] (the tokens at t+1 and their positions); states: [B, T, H]
        (hidden states at t). Returns float32 logits for the tokens at t+2 ([B, T, V]) and this
        layer's output states ([B, T, H]), which chain into the next step."""
        eps = self.spec.rms_norm_eps
        e = rms_norm(self._embed(input_ids), self.enorm, eps)
        x = linear(torch.cat([e, rms_norm(states.to(self.dtype), self.hnorm, eps)], dim=-1), self.eh_proj)
        cos, sin = cos_sin(self.inv_freq, positions, self.dtype)
        x = self._decoder_layer(self.layers[0], x, cos, sin, positions, cache, 0, slots, int(positions.max()) + 1)
        logits = self.tp.gather_last(F.linear(rms_norm(x, self.head_norm, eps), self.lm_head).float())
        return logits, x
