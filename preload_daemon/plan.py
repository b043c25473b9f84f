"""The load plan: which tensors one rank materialises, in which dtype and layout, at which slab
offset. Written once and used by both the daemon (destination: a shared slab) and the worker's cold
path (destination: private memory), which is why the two produce identical bytes."""

import dataclasses
import re

import torch

from preload_daemon.buffers import DTYPES
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError, PlanError

ALIGNMENT = 256
FORMAT_VERSION = 1
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
SCHEMES = ("none",)
# Schemes DESIGN.md names that this build does not implement yet: asked for, they get a clear error.
PLANNED_SCHEMES = ("fp8_per_tensor", "fp8_per_channel", "fp8_block", "int8", "mxfp8", "mxfp4", "nvfp4")
COMPONENTS = ("main", "draft")


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class LoadSpec:
    """What to load and how to lay it out for one rank."""

    path: str
    """Checkpoint directory."""
    name: str = ""
    """Model name in the daemon; defaults to the directory's base name."""
    dtype: str = "auto"
    """Target dtype of floating tensors; "auto" keeps config.json's torch_dtype."""
    quantization: str = "none"
    """Scheme for the linear projections (DESIGN.md section 5)."""
    tp_size: int = 1
    tp_rank: int = 0
    component: str = "main"
    """"main" for the model, "draft" for its MTP layers."""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.path.rstrip("/").rsplit("/", 1)[-1])
        if self.dtype not in DTYPE_CHOICES:
            raise PlanError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
        if self.quantization in PLANNED_SCHEMES:
            raise PlanError(f"quantization {self.quantization!r} is not available in this build yet; "
                            f"use one of: {', '.join(SCHEMES)}")
        if self.quantization not in SCHEMES:
            raise PlanError(f"unknown quantization scheme {self.quantization!r}; known: "
                            f"{', '.join(SCHEMES + PLANNED_SCHEMES)}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise PlanError(f"tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.component not in COMPONENTS:
            raise PlanError(f"unknown component {self.component!r}; choose one of {', '.join(COMPONENTS)}")


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """The slice of the source tensor this rank keeps: `length` rows/columns from `start` along `dim`."""

    dim: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
    name: str
    role: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    shard: Shard | None
    quant_scheme: str = "none"


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan:
    spec: LoadSpec
    architecture: str
    dtype: torch.dtype
    entries: tuple[PlanEntry, ...]
    total_bytes: int

    @property
    def source_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


# (pattern, role, parallel style). The first match wins.
_RULES: list[tuple[re.Pattern, str, str]] = [
    (re.compile(p), role, style) for p, role, style in [
        (r"(^|\.)embed_tokens\.weight$", "embedding", "vocab"),
        (r"(^lm_head|shared_head\.head)\.weight$", "lm_head", "vocab"),
        (r"norm\.weight$", "norm", "replicated"),
        (r"self_attn\.q_proj\.weight$", "linear", "column"),
        (r"self_attn\.q_proj\.bias$", "bias", "column"),
        (r"self_attn\.[kv]_proj\.weight$", "linear", "kv"),
        (r"self_attn\.[kv]_proj\.bias$", "bias", "kv"),
        (r"self_attn\.o_proj\.weight$", "linear", "row"),
        (r"mlp\.(gate|up)_proj\.weight$", "linear", "column"),
        (r"mlp\.down_proj\.weight$", "linear", "row"),
        (r"eh_proj\.weight$", "linear", "replicated"),
    ]
]
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def classify(name: str) -> tuple[str, str]:
    """(role, parallel style) of a checkpoint tensor, from its Hugging Face name."""
    for pattern, role, style in _RULES:
        if pattern.search(name):
            return role, style
    return "other", "replicated"


def build_plan(checkpoint: Checkpoint, spec: LoadSpec) -> LoadPlan:
    """The ordered tensors this rank materialises, with aligned slab offsets."""
    arch = checkpoint.architecture
    if arch not in ARCHITECTURES:
        raise PlanError(f"{checkpoint.path}: architecture {arch!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)}")
    dims = ModelDims.from_config(checkpoint.config, checkpoint.path)
    dims.check_tp(spec.tp_size)
    target = _target_dtype(checkpoint, spec)

    entries, offset = [], 0
    for name in _component_tensors(checkpoint, dims, spec.component):
        info = checkpoint.tensors[name]
        role, style = classify(name)
        dims.check_shape(name, role, info.shape)
        shard = dims.shard(style, info.shape, spec.tp_size, spec.tp_rank)
        shape = list(info.shape)
        if shard is not None:
            shape[shard.dim] = shard.length
        dtype = target if info.dtype.is_floating_point and info.dtype.itemsize > 1 else info.dtype
        nbytes = dtype.itemsize * _numel(shape)
        entries.append(PlanEntry(name, role, dtype, tuple(shape), offset, nbytes, shard))
        offset = _align(offset + nbytes)
    return LoadPlan(spec, arch, target, tuple(entries), max(offset, ALIGNMENT))


def execute(plan: LoadPlan, checkpoint: Checkpoint, dest: torch.Tensor, on_tensor=None, hasher=None) -> None:
    """Fills `dest` (a flat uint8 tensor of plan.total_bytes) with the plan's tensors, in order.
    `hasher` (hashlib-style) sees every byte of dest exactly once, padding included, as it is
    written; `on_tensor(entry)` is called after each tensor."""
    if dest.dtype != torch.uint8 or dest.numel() != plan.total_bytes:
        raise ValueError(f"destination must be {plan.total_bytes} uint8 bytes, got {dest.numel()} {dest.dtype}")
    hashed = end = 0
    scratch = torch.empty(0, dtype=torch.uint8)  # reused: bounded by the largest converted tensor
    for entry in plan.entries:
        scratch = _fill(checkpoint, entry, dest[entry.offset:entry.offset + entry.nbytes], scratch)
        end = _align(entry.offset + entry.nbytes)
        dest[entry.offset + entry.nbytes:end].zero_()  # padding: fresh private memory holds garbage
        if hasher is not None:
            hasher.update(memoryview(dest[hashed:end].numpy()))
            hashed = end
        if on_tensor is not None:
            on_tensor(entry)
    dest[end:].zero_()
    if hasher is not None and hashed < plan.total_bytes:
        hasher.update(memoryview(dest[hashed:].numpy()))


def _fill(checkpoint: Checkpoint, entry: PlanEntry, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Writes one planned tensor into `out`; returns the (possibly grown) scratch buffer."""
    if not entry.nbytes:
        return scratch
    info = checkpoint.tensors[entry.name]
    # A dim-0 shard is a contiguous byte range of the stored tensor: read only those rows.
    rows = entry.shard if entry.shard is not None and entry.shard.dim == 0 else None
    row_bytes = info.nbytes // info.shape[0]
    skip = rows.start * row_bytes if rows else 0
    length = rows.length * row_bytes if rows else info.nbytes
    if info.dtype == entry.dtype and entry.shard is rows:
        checkpoint.read_into(entry.name, out, skip)  # from the file to its place in one read
        return scratch
    if scratch.numel() < length:
        scratch = torch.empty(length, dtype=torch.uint8)
    checkpoint.read_into(entry.name, scratch[:length], skip)
    src = scratch[:length].view(info.dtype).view((rows.length, *info.shape[1:]) if rows else info.shape)
    if entry.shard is not None and rows is None:
        src = src.narrow(entry.shard.dim, entry.shard.start, entry.shard.length)
    out.view(entry.dtype).view(entry.shape).copy_(src)
    return scratch


def _target_dtype(checkpoint: Checkpoint, spec: LoadSpec) -> torch.dtype:
    if spec.dtype != "auto":
        return DTYPES[spec.dtype]
    name = checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype") or "bfloat16"
    if name not in DTYPE_CHOICES[1:]:
        raise CheckpointError(f"{checkpoint.path}/config.json: torch_dtype {name!r} is not one of "
                              f"{', '.join(DTYPE_CHOICES[1:])}; pass --dtype explicitly")
    return DTYPES[name]


def _component_tensors(checkpoint: Checkpoint, dims: "ModelDims", component: str) -> list[str]:
    """Tensor names of the component in a stable order: MTP layers (index >= num_hidden_layers)
    belong to the draft, everything else to the main model."""
    def layer(name: str) -> int | None:
        match = _LAYER_RE.match(name)
        return int(match.group(1)) if match else None

    names = sorted(checkpoint.tensors, key=lambda n: (layer(n) if layer(n) is not None else -1, n))
    if component == "main":
        return [n for n in names if layer(n) is None or layer(n) < dims.num_layers]
    draft = [n for n in names if layer(n) is not None and layer(n) >= dims.num_layers]
    if not draft:
        raise PlanError(f"{checkpoint.path}: component 'draft' asked for, but the checkpoint has no MTP layers "
                        "(num_nextn_predict_layers is 0 or absent)")
    return draft


@dataclasses.dataclass(frozen=True, slots=True)
class ModelDims:
    """The config.json numbers that shapes and sharding depend on."""

    path: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_layers: int

    @classmethod
    def from_config(cls, config: dict, path) -> "ModelDims":
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(str(path), hidden, heads, int(config.get("num_key_value_heads") or heads),
                       int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                       int(config["vocab_size"]), int(config["num_hidden_layers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}/config.json: missing or bad field {e}; it needs hidden_size, "
                                  "num_attention_heads, intermediate_size, vocab_size, num_hidden_layers") from e

    def check_tp(self, tp: int) -> None:
        problems = []
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} (nor does it divide {tp})")
        if self.intermediate % tp:
            problems.append(f"intermediate_size={self.intermediate}")
        if self.vocab % tp:
            problems.append(f"vocab_size={self.vocab}")
        if problems:
            raise PlanError(f"{self.path}: tp_size {tp} does not divide {', '.join(problems)}; pick a TP size "
                            "that divides the head counts")

    def check_shape(self, name: str, role: str, shape: tuple[int, ...]) -> None:
        expected = self._expected(name, role)
        if expected is not None and tuple(shape) != expected:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(shape)} but config.json implies "
                                  f"{list(expected)}; the config does not belong to these weights")

    def _expected(self, name: str, role: str) -> tuple[int, ...] | None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        table = {
            "q_proj.weight": (q, self.hidden), "k_proj.weight": (kv, self.hidden),
            "v_proj.weight": (kv, self.hidden), "o_proj.weight": (self.hidden, q),
            "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
            "gate_proj.weight": (self.intermediate, self.hidden), "up_proj.weight": (self.intermediate, self.hidden),
            "down_proj.weight": (self.hidden, self.intermediate),
            "q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,),
        }
        for suffix, shape in table.items():
            if name.endswith(suffix):
                return shape
        if role in ("embedding", "lm_head"):
            return (self.vocab, self.hidden)
        if role == "norm":
            return (self.hidden,)
        return None

    def shard(self, style: str, shape: tuple[int, ...], tp: int, rank: int) -> Shard | None:
        if tp == 1 or style == "replicated":
            return None
        if style in ("column", "vocab"):
            return Shard(0, rank * shape[0] // tp, shape[0] // tp)
        if style == "row":
            return Shard(1, rank * shape[1] // tp, shape[1] // tp)
        # kv: split by heads; with fewer kv heads than ranks, each rank keeps one (replicated) head.
        if self.num_kv_heads >= tp:
            return Shard(0, rank * shape[0] // tp, shape[0] // tp)
        head = rank * self.num_kv_heads // tp
        return Shard(0, head * self.head_dim, self.head_dim)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
