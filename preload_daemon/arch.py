"""One architecture spec per checkpoint: config.json read once into typed numbers (hfconfig.py reads
the file and checks the fields' types), plus one table of tensor kinds (name pattern, role, parallel
style, expected full shape, quantizable). The load plan, the shape checks and the engine's model all
read this module; adding an architecture or a tensor kind means editing it alone."""

import dataclasses
from collections.abc import Callable

from kernels import formats
from preload_daemon.errors import CheckpointError, PlanError
from preload_daemon.hfconfig import (MAX_LAYERS, architecture_name, bool_field, eos_field, float_field, int_field,
                                     rope_config)
from preload_daemon.safepath import short_repr

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
SCHEMES = ("none", *formats.SCHEMES)
MAX_TP = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Architecture:
    """What distinguishes one supported Hugging Face model class from another."""

    qkv_bias: bool
    """q, k and v projections carry biases (Qwen2)."""
    qk_norm: bool
    """q and k are RMS-normalised per head before the rotation (Qwen3)."""


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Architecture(qkv_bias=False, qk_norm=True),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """The slice of a stored tensor one rank keeps: `length` rows/columns from `start` along `dim`."""

    dim: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class TensorKind:
    """One kind of checkpoint tensor. `template` is its Hugging Face name with `{layer}` where the
    layer index goes; `style` says how TP splits it: "column" (output rows), "row" (input columns),
    "kv" (rows by kv head, replicated when there are fewer kv heads than ranks), "vocab" (rows by
    vocabulary) or "replicated"."""

    key: str
    template: str
    role: str
    style: str
    shape: Callable[["ArchSpec"], tuple[int, ...]]
    quantizable: bool = False
    mtp: bool = False
    """Part of a DeepSeek-V3-style MTP layer only (the draft component)."""


def _hidden(s):
    return (s.hidden_size,)


_LAYER = "model.layers.{layer}."
KINDS: tuple[TensorKind, ...] = (
    TensorKind("embed", "model.embed_tokens.weight", "embedding", "vocab", lambda s: (s.vocab_size, s.hidden_size)),
    TensorKind("lm_head", "lm_head.weight", "lm_head", "vocab", lambda s: (s.vocab_size, s.hidden_size)),
    TensorKind("norm", "model.norm.weight", "norm", "replicated", _hidden),
    TensorKind("input_norm", _LAYER + "input_layernorm.weight", "norm", "replicated", _hidden),
    TensorKind("post_norm", _LAYER + "post_attention_layernorm.weight", "norm", "replicated", _hidden),
    TensorKind("q", _LAYER + "self_attn.q_proj.weight", "linear", "column", lambda s: (s.q_size, s.hidden_size), True),
    TensorKind("k", _LAYER + "self_attn.k_proj.weight", "linear", "kv", lambda s: (s.kv_size, s.hidden_size), True),
    TensorKind("v", _LAYER + "self_attn.v_proj.weight", "linear", "kv", lambda s: (s.kv_size, s.hidden_size), True),
    TensorKind("o", _LAYER + "self_attn.o_proj.weight", "linear", "row", lambda s: (s.hidden_size, s.q_size), True),
    TensorKind("q_bias", _LAYER + "self_attn.q_proj.bias", "bias", "column", lambda s: (s.q_size,)),
    # Added once, after the row-parallel o_proj's all-reduce (attention_bias).
    TensorKind("o_bias", _LAYER + "self_attn.o_proj.bias", "bias", "replicated", _hidden),
    TensorKind("k_bias", _LAYER + "self_attn.k_proj.bias", "bias", "kv", lambda s: (s.kv_size,)),
    TensorKind("v_bias", _LAYER + "self_attn.v_proj.bias", "bias", "kv", lambda s: (s.kv_size,)),
    TensorKind("q_norm", _LAYER + "self_attn.q_norm.weight", "norm", "replicated", lambda s: (s.head_dim,)),
    TensorKind("k_norm", _LAYER + "self_attn.k_norm.weight", "norm", "replicated", lambda s: (s.head_dim,)),
    TensorKind("gate", _LAYER + "mlp.gate_proj.weight", "linear", "column",
               lambda s: (s.intermediate_size, s.hidden_size), True),
    TensorKind("up", _LAYER + "mlp.up_proj.weight", "linear", "column",
               lambda s: (s.intermediate_size, s.hidden_size), True),
    TensorKind("down", _LAYER + "mlp.down_proj.weight", "linear", "row",
               lambda s: (s.hidden_size, s.intermediate_size), True),
    # DeepSeek-V3 MTP layers (model.layers.{L+i}): these plus one full decoder layer.
    TensorKind("mtp_embed", _LAYER + "embed_tokens.weight", "embedding", "vocab",
               lambda s: (s.vocab_size, s.hidden_size), mtp=True),
    TensorKind("enorm", _LAYER + "enorm.weight", "norm", "replicated", _hidden, mtp=True),
    TensorKind("hnorm", _LAYER + "hnorm.weight", "norm", "replicated", _hidden, mtp=True),
    TensorKind("eh_proj", _LAYER + "eh_proj.weight", "linear", "replicated",
               lambda s: (s.hidden_size, 2 * s.hidden_size), True, mtp=True),
    TensorKind("head_norm", _LAYER + "shared_head.norm.weight", "norm", "replicated", _hidden, mtp=True),
    TensorKind("head", _LAYER + "shared_head.head.weight", "lm_head", "vocab",
               lambda s: (s.vocab_size, s.hidden_size), mtp=True),
)
KIND = {kind.key: kind for kind in KINDS}
# Stored by some exporters, derived at run time by everyone: never loaded.
IGNORED = "rotary_emb.inv_freq"


def ignored(name: str) -> bool:
    """Whether a checkpoint tensor is one that is never loaded (IGNORED, alone or after a dot)."""
    return name.endswith(IGNORED) and (len(name) == len(IGNORED) or name[-len(IGNORED) - 1] == ".")


def _name_tables(kinds) -> tuple[dict[str, TensorKind], dict[str, dict[str, TensorKind]]]:
    """{name: kind} of the kinds without a layer, and {prefix: {suffix: kind}} of those with one
    (the template split at `{layer}`): a name is classified by dictionary lookups, not by trying a
    pattern per kind (a big model has ~90,000 names)."""
    exact, layered = {}, {}
    for kind in kinds:
        prefix, layer, suffix = kind.template.partition("{layer}")
        if not layer:
            exact[kind.template] = kind
            continue
        # The layer number ends at the first dot after the prefix (classify).
        assert suffix.startswith(".") and "{layer}" not in suffix, kind.template
        layered.setdefault(prefix, {})[suffix] = kind
    return exact, layered


_EXACT, _LAYERED = _name_tables(KINDS)


def classify(name: str) -> tuple[TensorKind, int | None] | None:
    """(kind, layer index or None) of a checkpoint tensor name, or None if no kind's template
    matches all of it, `{layer}` standing for 1-9 decimal digits (int() of a 5000-digit number
    fails)."""
    kind = _EXACT.get(name)
    if kind is not None:
        return kind, None
    for prefix, suffixes in _LAYERED.items():
        if name.startswith(prefix):
            dot = name.find(".", len(prefix))
            digits = name[len(prefix):dot]
            kind = suffixes.get(name[dot:]) if dot >= 0 else None
            if kind is not None and 0 < len(digits) <= 9 and digits.isdecimal():
                return kind, int(digits)
    return None


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class ArchSpec:
    """The numbers of config.json that shapes, sharding and the forward pass depend on."""

    source: str
    """Where the config came from, for messages."""
    architecture: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    num_mtp_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = ""
    """config.json's torch_dtype (or dtype), "" when absent."""
    attention_bias: bool = False
    """q, k, v and o projections carry biases (config.json's attention_bias, Llama and Qwen3)."""

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "ArchSpec":
        arch = architecture_name(config, source)
        if arch not in ARCHITECTURES:
            raise PlanError(f"{source}: architecture {short_repr(arch or 'missing')} is not supported; supported: "
                            f"{', '.join(ARCHITECTURES)}")
        hidden = int_field(config, "hidden_size", source)
        heads = int_field(config, "num_attention_heads", source)
        kv_heads = int_field(config, "num_key_value_heads", source, heads)
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={kv_heads}; each kv head must serve whole query heads")
        if config.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                                  "set head_dim explicitly")
        max_pos = int_field(config, "max_position_embeddings", source, 4096)
        head_dim = int_field(config, "head_dim", source, hidden // heads)
        if head_dim % 2:
            given = "" if config.get("head_dim") is not None else \
                f" (hidden_size {hidden} / num_attention_heads {heads})"
            raise CheckpointError(f"{source}: head_dim={head_dim}{given} is odd; rotary embeddings turn pairs of a "
                                  "head's elements, so no Llama-style model has one (transformers refuses it too)")
        theta, scaling = rope_config(config, source, head_dim, max_pos)
        eos = eos_field(config, source)
        dtype = config.get("torch_dtype") or config.get("dtype") or ""
        if not isinstance(dtype, str):
            raise CheckpointError(f"{source}: torch_dtype must be a string such as \"bfloat16\", "
                                  f"got {short_repr(dtype)}")
        return cls(
            source=source, architecture=arch, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int_field(config, "intermediate_size", source), vocab_size=int_field(config, "vocab_size", source),
            num_layers=int_field(config, "num_hidden_layers", source, maximum=MAX_LAYERS),
            num_mtp_layers=int_field(config, "num_nextn_predict_layers", source, 0, minimum=0, maximum=MAX_LAYERS),
            rms_norm_eps=float_field(config, "rms_norm_eps", source, 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool_field(config, "tie_word_embeddings", source),
            max_position_embeddings=max_pos, eos_token_ids=eos, torch_dtype=dtype,
            # Qwen2's q/k/v biases are fixed (flags.qkv_bias); Llama and Qwen3 follow attention_bias.
            attention_bias=arch != "Qwen2ForCausalLM" and bool_field(config, "attention_bias", source))

    def differences(self, other: "ArchSpec") -> list[str]:
        """The fields that decide weight shapes and the forward pass in which `other` differs."""
        fields = ("architecture", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "num_layers", "num_mtp_layers", "tie_word_embeddings", "attention_bias")
        return [f"{f} ({getattr(self, f)!r} vs {getattr(other, f)!r})" for f in fields
                if getattr(self, f) != getattr(other, f)]

    # -- derived numbers -----------------------------------------------------------------------

    @property
    def flags(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def context_len(self, requested: int) -> int:
        """Positions a KV cache holds for `requested`: never past max_position_embeddings. Every TP
        rank sizes its cache with this, so rank 0's positions fit all of them."""
        return min(requested, self.max_position_embeddings)

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, kv heads) one of `tp` ranks holds: kv heads are replicated when there are
        fewer of them than ranks."""
        return self.num_heads // tp, max(1, self.num_kv_heads // tp)

    # -- tensors -------------------------------------------------------------------------------

    def name(self, key: str, layer: int | None = None) -> str:
        """The Hugging Face name of tensor kind `key` (in decoder layer `layer`)."""
        return KIND[key].template.format(layer=layer)

    def required(self) -> list[str]:
        """Every tensor the main component needs."""
        names = [self.name("embed"), self.name("norm")]
        if not self.tie_word_embeddings:
            names.append(self.name("lm_head"))
        keys = ["input_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down"]
        keys += ["q_bias", "k_bias", "v_bias"] if self.flags.qkv_bias or self.attention_bias else []
        keys += ["o_bias"] if self.attention_bias else []
        keys += ["q_norm", "k_norm"] if self.flags.qk_norm else []
        # Joined, not formatted: a model of 20,000 tensors spent 15 ms here through name().
        parts = [KIND[k].template.split("{layer}") for k in keys]
        return names + [f"{prefix}{i}{suffix}" for i in range(self.num_layers) for prefix, suffix in parts]

    def check_shape(self, name: str, kind: TensorKind, shape: tuple[int, ...]) -> None:
        expected = kind.shape(self)
        if tuple(shape) != expected:
            raise CheckpointError(f"{self.source}: tensor {name!r} has shape {short_repr(list(shape))} but config.json "
                                  f"implies {list(expected)}; the config does not belong to these weights")

    # -- tensor parallelism --------------------------------------------------------------------

    def tp_problems(self, tp: int, quantization: str = "none") -> list[str]:
        """Why `tp` ranks cannot split this model (quantized with `quantization`); empty if they can."""
        problems = []
        for what, n in (("num_attention_heads", self.num_heads), ("intermediate_size", self.intermediate_size),
                        ("vocab_size", self.vocab_size)):
            if n % tp:
                problems.append(f"{what}={n} is not divisible by {tp}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} neither divides nor is divisible by {tp}")
        # A TP shard of a quantized projection falls on whole blocks, so every rank's parts are
        # exactly the TP=1 parts sliced (kernels.quant.narrow).
        rows, cols = formats.FORMATS[quantization].block if quantization in formats.FORMATS else (1, 1)
        if problems or tp == 1 or (rows, cols) == (1, 1):
            return problems
        heads, kv_heads = self.local_heads(tp)
        shards = {"q_proj rows": heads * self.head_dim, "k/v_proj rows": kv_heads * self.head_dim,
                  "gate/up_proj rows": self.intermediate_size // tp}
        for what, n in shards.items():
            if n % rows:
                problems.append(f"{what} per rank = {n}, not a multiple of {quantization}'s {rows}-row block")
        for what, n in {"o_proj columns": heads * self.head_dim,
                        "down_proj columns": self.intermediate_size // tp}.items():
            if n % cols:
                problems.append(f"{what} per rank = {n}, not a multiple of {quantization}'s {cols}-element block")
        return problems

    def check_tp(self, tp: int, quantization: str = "none") -> None:
        if tp < 1:
            raise PlanError(f"tp_size must be at least 1, got {tp}")
        problems = self.tp_problems(tp, quantization)
        if problems:
            fits = [n for n in range(1, MAX_TP + 1) if not self.tp_problems(n, quantization)]
            raise PlanError(f"{self.source}: tp_size {tp} does not fit this model"
                            f"{'' if quantization == 'none' else ' quantized with ' + quantization}: "
                            f"{'; '.join(problems)}; TP sizes that fit: {', '.join(map(str, fits))}")

    def shard(self, kind: TensorKind, shape: tuple[int, ...], tp: int, rank: int) -> Shard | None:
        """The part of a stored tensor rank `rank` of `tp` keeps; None for all of it."""
        if tp == 1 or kind.style == "replicated" or (kind.style == "row" and len(shape) < 2):
            return None
        if kind.style in ("column", "vocab"):
            return Shard(0, rank * shape[0] // tp, shape[0] // tp)
        if kind.style == "row":
            return Shard(1, rank * shape[1] // tp, shape[1] // tp)
        if self.num_kv_heads >= tp:  # kv
            return Shard(0, rank * shape[0] // tp, shape[0] // tp)
        head = rank * self.num_kv_heads // tp
        return Shard(0, head * self.head_dim, self.head_dim)
