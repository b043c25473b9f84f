"""Llama, Qwen2 and Qwen3 decoders built directly on the tensors a loader hands over: the model
keeps references to those tensors (views into a slab, or private memory) and never copies them."""

import dataclasses
import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kernels.activation import silu_mul
from kernels import native
from kernels.attention import cached_attention, decode_attention, has_prefill_attention, prefill_attention
from kernels.decode_layer import FusedLayers, fused_layer
from kernels.dense import Dense
from kernels.linear import linear
from kernels.norm import rms_norm
from kernels.quant import QuantizedWeight
from kernels.rope import attention_factor, inv_freq, rope_table, rotate
from preload_daemon.arch import ArchSpec
from preload_daemon.errors import CheckpointError
from worker.kv_cache import KVCache, Step, plan_step

Weight = torch.Tensor | QuantizedWeight  # the attention and MLP projections may be quantized
log = logging.getLogger(__name__)


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
    qkv: tuple = ()
    """q, k and v grouped as `runs` does: (weight or view, bias, members) per product."""
    gate_up: torch.Tensor | None = None
    """gate and up as one view when they lie back to back (see `adjacent`)."""


class CausalLM:
    """The decoder of one tensor-parallel rank (all of it when `tp` is a SingleRank): its weights
    are this rank's shards as the load plan laid them out (kernels are unchanged), and the group
    exchanges partial sums after the row-parallel projections and the vocabulary-parallel
    embedding, and gathers the vocabulary-parallel logits. Hidden states run as [B * T, hidden]
    rows; only attention sees the batch. A decode step of an unsplit model runs all its layers in one
    native call where the native kernels are chosen (kernels/decode_layer.py), else op by op."""

    fused: FusedLayers | None = None

    def __init__(self, spec: ArchSpec, weights: Mapping[str, Weight], tp=None):
        self.spec = spec
        self.tp = tp or SingleRank()
        missing = [n for n in spec.required() if n not in weights]
        if missing:
            raise CheckpointError(f"the weights lack {len(missing)} tensor(s) the model needs, e.g. "
                                  f"{', '.join(missing[:3])}; refusing to build a model with uninitialised weights")
        self._common(spec, weights)
        self.norm = weights[spec.name("norm")]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.fused = self._fuse()

    def _fuse(self) -> FusedLayers | None:
        """Every layer's fused decode step, or None (decode steps then run op by op) where the
        model is split or any layer cannot run fused."""
        if self.tp.size != 1:
            return None
        fused = []
        for layer in self.layers:
            one = fused_layer(
                projections={n: getattr(layer, n) for n in ("q", "k", "v", "o", "gate", "up", "down")},
                norms=(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm),
                biases={n: getattr(layer, f"{n}_bias") for n in ("q", "k", "v", "o")}, heads=self.num_heads,
                kv_heads=self.num_kv_heads, head_dim=self.spec.head_dim, eps=self.spec.rms_norm_eps)
            if isinstance(one, str):
                log.debug("decode steps run op by op: %s", one)
                return None
            fused.append(one)
        return FusedLayers(fused)

    def _common(self, spec: ArchSpec, weights: Mapping[str, Weight]) -> None:
        self.num_heads, self.num_kv_heads = spec.local_heads(self.tp.size)
        self.embed = weights[spec.name("embed")]
        self.lm_head = weights.get(spec.name("lm_head"), self.embed) if spec.tie_word_embeddings \
            else weights[spec.name("lm_head")]
        self.vocab_start = self.tp.rank * self.embed.shape[0]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        """Where the weights are, and so every activation and the cache (logits come back on the CPU)."""
        self.inv_freq = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.rope_scale = attention_factor(spec.rope_scaling)
        self.dense = Dense(self.device)
        self._rope = rope_table(self.inv_freq, 0, self.dtype, self.rope_scale).to(self.device)

    @classmethod
    def from_config(cls, config: dict, weights: Mapping[str, Weight], tp=None) -> "CausalLM":
        """The model for a config.json document over `weights`."""
        return cls(ArchSpec.from_config(config), weights, tp)

    def _layer(self, w, i: int) -> Layer:
        def get(key: str):
            return w.get(self.spec.name(key, i))
        layer = Layer(input_norm=get("input_norm"), post_norm=get("post_norm"), q=get("q"), k=get("k"), v=get("v"),
                      o=get("o"), gate=get("gate"), up=get("up"), down=get("down"), q_bias=get("q_bias"),
                      k_bias=get("k_bias"), v_bias=get("v_bias"), o_bias=get("o_bias"), q_norm=get("q_norm"),
                      k_norm=get("k_norm"))
        layer.qkv = runs((layer.q, layer.k, layer.v), (layer.q_bias, layer.k_bias, layer.v_bias))
        layer.gate_up = adjacent(layer.gate, layer.up)
        return layer

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(len(self.layers), self.num_kv_heads, self.spec.head_dim, num_slots, max_len, self.dtype,
                       self.device)

    @staticmethod
    def copy_cache(cache: KVCache, source: int, targets: list[int], length: int) -> None:
        """The first `length` positions of slot `source`, every layer's, into each of `targets` (the
        choices of one prompt, n > 1, share its prefill)."""
        cache.all[:, targets, ..., :length, :] = cache.all[:, source:source + 1, ..., :length, :]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step of one sequence reads: every layer's, the final norm,
        the lm_head and one embedding row."""
        def size(w) -> int:
            return w.nbytes if isinstance(w, (torch.Tensor, QuantizedWeight)) else 0
        fields = ("input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down", "q_bias", "k_bias", "v_bias",
                  "o_bias", "q_norm", "k_norm")
        layers = sum(size(getattr(layer, f)) for layer in self.layers for f in fields)
        return layers + size(self.norm) + size(self.lm_head) + self.embed[0].nbytes

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, exact: bool = False):
        """x @ w.T on the fastest path for the weight's kind and x's rows (Dense's `exact`)."""
        return self.dense(x, w, bias, exact) if isinstance(w, torch.Tensor) else linear(x, w, bias)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                all_logits: bool = False, hidden: bool = False):
        """input_ids, positions: [B, T]; slots: [B] cache slots. Writes the new keys and values into
        the cache and returns float32 logits for the last position of each row ([B, V]), or for every
        position ([B, T, V]) with all_logits; with `hidden`, (logits, the last layer's output before
        the final norm, [B, T, H]) for an MTP draft."""
        batch, t = input_ids.shape
        step = self._step(positions, slots, cache)
        x = self._embed(input_ids.reshape(-1).to(self.device))
        if self.fused and step.rope is not None and batch <= self.fused.max_rows and native.variant_index() >= 0:
            x = self.fused(x, cache.all, step.slot_ids, step.lengths, step.rope)
        else:
            for i, layer in enumerate(self.layers):
                x = self._decoder_layer(layer, x, step, cache.layers[i], i)
        states = x.view(batch, t, -1)
        x = states if all_logits else states[:, -1]
        logits = self._logits(rms_norm(x, self.norm, self.spec.rms_norm_eps), step.exact)
        return (logits, states) if hidden else logits

    def _logits(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        return self.tp.gather_last(self.dense(x, self.lm_head, exact=exact).float()).cpu()  # sampled on the CPU

    def _step(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> Step:
        batch, t = positions.shape
        rows = positions.tolist()
        length = max(map(max, rows)) + 1
        if length > self._rope.shape[0]:
            grown = rope_table(self.inv_freq, max(length, 2 * self._rope.shape[0], 256), self.dtype, self.rope_scale)
            self._rope = grown.to(self.device)
        table = self._rope[positions.reshape(-1)].unsqueeze(1)  # [B * T, 1, 2, D]
        return plan_step(positions, rows, length, slots, cache, table)

    def _decoder_layer(self, layer: Layer, x: torch.Tensor, step: Step, kv: torch.Tensor, i: int) -> torch.Tensor:
        eps, exact = self.spec.rms_norm_eps, step.exact
        x = x + self._attention(layer, rms_norm(x, layer.input_norm, eps), step, kv, i)
        h = rms_norm(x, layer.post_norm, eps)
        if layer.gate_up is not None:
            gate, up = self.linear(h, layer.gate_up, None, exact).chunk(2, dim=-1)
        else:
            gate, up = self.linear(h, layer.gate, None, exact), self.linear(h, layer.up, None, exact)
        return x + self.tp.all_reduce(self.linear(silu_mul(gate, up), layer.down, None, exact))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        # This rank holds rows [vocab_start, vocab_start + local): look those up, zeros elsewhere, sum.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill(outside[..., None], 0)
        return self.tp.all_reduce(x)

    def _attention(self, layer: Layer, h: torch.Tensor, step: Step, kv: torch.Tensor, i: int) -> torch.Tensor:
        heads, kv_heads, head_dim, exact = self.num_heads, self.num_kv_heads, self.spec.head_dim, step.exact
        rows = h.shape[0]
        qkv = self._project(h, layer.qkv, exact).view(rows, heads + 2 * kv_heads, head_dim)
        qk = qkv[:, :heads + kv_heads]
        if layer.q_norm is not None:
            eps = self.spec.rms_norm_eps
            qk = torch.cat((rms_norm(qk[:, :heads], layer.q_norm, eps), rms_norm(qk[:, heads:], layer.k_norm, eps)), 1)
        qk = rotate(qk, step.cos, step.sin, out=qkv[:, :heads + kv_heads])
        q, new = qk[:, :heads], qkv[:, heads:]
        if exact:  # one sequence: its new positions of the cache are one view
            step.writes[i].copy_(new.view(-1, 2, kv_heads, head_dim).permute(1, 2, 0, 3))
        else:
            batch, t = step.positions.shape
            kv[step.slots, :, :, step.positions] = new.view(batch, t, 2, kv_heads, head_dim)
        if step.lengths is not None:
            out = decode_attention(q, kv, step.slot_ids, step.lengths)
        elif step.causal:
            out = self._attend_new(q, new, kv, step)
        elif exact:
            out = self._attend_one(q, step, i)
        else:
            live = step.keys[i] if step.keys else kv[..., :step.length, :].index_select(0, step.slots[:, 0])
            cached = live.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
            out = cached_attention(q.view(batch, t, heads, head_dim), cached[0], cached[1], step.hidden)
        out = self.tp.all_reduce(self.linear(out.reshape(rows, -1), layer.o, None, exact))
        return out + layer.o_bias if layer.o_bias is not None else out

    def _project(self, h: torch.Tensor, grouped: tuple, exact: bool) -> torch.Tensor:
        """The outputs of `runs`-grouped projections, concatenated in their original order."""
        if len(grouped) == 1 and grouped[0][2] == tuple(range(len(grouped[0][2]))):
            weight, bias, _ = grouped[0]
            return self.linear(h, weight, bias, exact)
        pieces = {}
        for weight, bias, members in grouped:
            out = self.linear(h, weight, bias, exact)
            if len(members) == 1:
                pieces[members[0]] = out
            else:
                widths = [self._width(m) for m in members]
                pieces.update(zip(members, out.split(widths, dim=-1)))
        return torch.cat([pieces[i] for i in range(len(pieces))], dim=-1)

    def _width(self, member: int) -> int:
        """Output width of q (0), k (1) or v (2) on this rank."""
        return (self.num_heads if member == 0 else self.num_kv_heads) * self.spec.head_dim

    def _attend_new(self, q: torch.Tensor, new: torch.Tensor, kv: torch.Tensor, step: Step) -> torch.Tensor:
        """Attention of rows of T positions from 0 over their new keys alone: q [B * T, H, D], new
        [B * T, 2 * KV, D], already written to this layer's cache `kv`. Returns [B * T, H, D]. Each
        row is computed as it is alone, and no [T, T] mask is made. On the kernels with AVX512-BF16's
        dot product a bfloat16 model runs the native prefill attention over the cache (one 500-token
        prompt on a 2-core Zen 4: 1.9-2.2 ms a layer against SDPA's 4.3-5.9; 2,000 tokens 30-32 against 38-40);
        elsewhere, torch's causal SDPA, as transformers runs it. With cached_attention's mask and
        float32 scores, 8 prompts of 500 tokens prefilled together had taken 5.9-9.3 s against
        3.7-4.8 one after another (int8, 2-core Zen 4); SDPA's causal kernel took 3.9-4.2."""
        rows, heads, head_dim = q.shape
        t = step.length
        if has_prefill_attention(q.dtype, q.device, head_dim) and kv.dtype == q.dtype:
            return prefill_attention(q.view(rows // t, t, heads, head_dim), kv, step.slot_ids).view(rows, heads, head_dim)
        batch, kv_heads = rows // t, self.num_kv_heads
        keys, values = new.view(batch, t, 2, kv_heads, head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q.view(batch, t, heads, head_dim).transpose(1, 2), keys, values,
                                             is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(rows, heads, head_dim)

    def _attend_one(self, q: torch.Tensor, step: Step, i: int) -> torch.Tensor:
        """One sequence's attention past position 0 over its cached keys (its new ones already
        written there), with torch's SDPA, as transformers runs it: q [T, H, D]. Returns [T, H, D]."""
        t, heads, head_dim = q.shape
        if t == 1:  # decode: the fewest calls
            return F.scaled_dot_product_attention(q.view(1, heads, 1, head_dim), step.keys[i], step.values[i],
                                                  enable_gqa=True).reshape(1, heads, head_dim)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], step.keys[i], step.values[i],
                                             attn_mask=step.visible, enable_gqa=True)
        return out[0].transpose(0, 1)


def runs(weights: tuple, biases: tuple) -> tuple:
    """Projections of one input grouped into as few products as memory allows: ((weight or view,
    bias, member indices in memory order), ...), one per run of weights that lie back to back (and
    all have a bias, or none has)."""
    order = sorted(range(len(weights)), key=lambda i: _address(weights[i]))
    groups = [[order[0]]]
    for i in order[1:]:
        same_bias = (biases[i] is None) == (biases[groups[-1][0]] is None)
        if same_bias and adjacent(*(weights[j] for j in groups[-1]), weights[i]) is not None:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for members in groups:
        members_biases = [biases[i] for i in members]
        bias = None if members_biases[0] is None else torch.cat(members_biases)  # a few KB
        out.append((adjacent(*(weights[i] for i in members)) if len(members) > 1 else weights[members[0]], bias,
                    tuple(members)))
    return tuple(out)


def _address(w: Weight) -> int:
    return (w if isinstance(w, torch.Tensor) else w.weight).data_ptr()


def adjacent(*weights: Weight | None) -> torch.Tensor | None:
    """One [sum N, K] view over plain weights that lie back to back in the same memory (the slab
    places a layer's tensors in checkpoint order), so that one GEMV reads them all; None if they do
    not (or any is quantized). Never copies."""
    if any(not isinstance(w, torch.Tensor) for w in weights):
        return None
    first = weights[0]
    expected = first.data_ptr()
    for w in weights:
        if (w.dim() != 2 or not w.is_contiguous() or w.dtype != first.dtype or w.shape[1] != first.shape[1]
                or w.data_ptr() != expected or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        expected += w.nbytes
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))

