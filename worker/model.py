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
from preload_daemon.errors import CheckpointError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
Weight = torch.Tensor | QuantizedWeight  # the attention and MLP projections may be quantized


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """The numbers of config.json the forward pass needs."""

    architecture: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    """Qwen2 (and Llama with attention_bias) add biases to q, k and v."""
    qk_norm: bool
    """Qwen3 normalises each head of q and k before the rotation."""
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        arch = (config.get("architectures") or [""])[0]
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"architecture {arch!r} is not supported by the engine; supported: "
                                  f"{', '.join(ARCHITECTURES)}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = dict(rope) if (rope.get("rope_type") or rope.get("type") or "default") != "default" else None
        if scaling is not None:
            scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
        eos = config.get("eos_token_id")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            architecture=arch, hidden_size=hidden, num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM", max_position_embeddings=config.get("max_position_embeddings", 4096),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []))


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
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class KVCache:
    """Static per-slot cache: [num_layers] x [slots, kv_heads, max_len, head_dim] for keys and values.
    It lives in one anonymous mapping, whose pages the kernel zero-fills on first touch: a large
    cache costs nothing at start-up, and unwritten positions read as zeros, never garbage."""

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype):
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)
        per_tensor = num_slots * config.num_kv_heads * max_len * config.head_dim
        self._mapping = mmap.mmap(-1, 2 * config.num_layers * per_tensor * dtype.itemsize)
        flat = torch.frombuffer(self._mapping, dtype=dtype)
        views = [flat[i * per_tensor:(i + 1) * per_tensor].view(shape) for i in range(2 * config.num_layers)]
        self.k, self.v = views[0::2], views[1::2]
        self.num_slots = num_slots
        self.max_len = max_len


class CausalLM:
    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight]):
        self.config = config
        missing = [n for n in self._required(weights) if n not in weights]
        if missing:
            raise CheckpointError(f"the weights lack {len(missing)} tensor(s) the model needs, e.g. "
                                  f"{', '.join(missing[:3])}; refusing to build a model with uninitialised weights")
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed) if config.tie_word_embeddings \
            else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        self.dtype = self.embed.dtype
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.inv_freq = inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def _required(self, weights) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            if self.config.qkv_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if self.config.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def _layer(self, w, p: str) -> Layer:
        a = p + "self_attn."
        return Layer(
            input_norm=w[p + "input_layernorm.weight"], post_norm=w[p + "post_attention_layernorm.weight"],
            q=w[a + "q_proj.weight"], k=w[a + "k_proj.weight"], v=w[a + "v_proj.weight"], o=w[a + "o_proj.weight"],
            gate=w[p + "mlp.gate_proj.weight"], up=w[p + "mlp.up_proj.weight"], down=w[p + "mlp.down_proj.weight"],
            q_bias=w.get(a + "q_proj.bias"), k_bias=w.get(a + "k_proj.bias"), v_bias=w.get(a + "v_proj.bias"),
            q_norm=w.get(a + "q_norm.weight"), k_norm=w.get(a + "k_norm.weight"))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """input_ids, positions: [B, T]; slots: [B] cache slots. Writes the new keys and values into
        the cache and returns float32 logits for the last position of each row ([B, V]), or for every
        position ([B, T, V]) with all_logits."""
        cfg = self.config
        x = F.embedding(input_ids, self.embed)
        cos, sin = cos_sin(self.inv_freq, positions, self.dtype)
        length = int(positions.max()) + 1
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(layer, h, cos, sin, positions, cache, i, slots, length)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + linear(silu_mul(linear(h, layer.gate), linear(h, layer.up)), layer.down)
        if not all_logits:
            x = x[:, -1]
        return F.linear(rms_norm(x, self.norm, cfg.rms_norm_eps), self.lm_head).float()

    def _attention(self, layer: Layer, h, cos, sin, positions, cache: KVCache, index: int, slots, length: int):
        cfg = self.config
        batch, t, _ = h.shape
        q = linear(h, layer.q, layer.q_bias).view(batch, t, cfg.num_heads, cfg.head_dim)
        k = linear(h, layer.k, layer.k_bias).view(batch, t, cfg.num_kv_heads, cfg.head_dim)
        v = linear(h, layer.v, layer.v_bias).view(batch, t, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        k_cache, v_cache = cache.k[index], cache.v[index]
        if batch == 1:
            start = int(positions[0, 0])
            k_cache[slots[0], :, start:start + t] = k[0]
            v_cache[slots[0], :, start:start + t] = v[0]
            keys, values = k_cache[slots[0], None, :, :length], v_cache[slots[0], None, :, :length]
        else:  # batched decode: one new token per row, each at its own position
            k_cache[slots, :, positions[:, 0]] = k[:, :, 0]
            v_cache[slots, :, positions[:, 0]] = v[:, :, 0]
            keys, values = k_cache[slots, :, :length], v_cache[slots, :, :length]
        out = attention(q, keys, values, positions)
        return linear(out.transpose(1, 2).reshape(batch, t, cfg.num_heads * cfg.head_dim), layer.o)
