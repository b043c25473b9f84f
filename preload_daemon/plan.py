"""The load plan: which tensors one rank materialises, in which dtype and layout, at which slab
offset. Written once and used by both the daemon (destination: a shared slab) and the worker's cold
path (destination: private memory), which is why the two produce identical bytes."""

import dataclasses
import math
import typing

import torch

from kernels import formats, quant
from preload_daemon.arch import DTYPE_CHOICES, KIND, SCHEMES, ArchSpec, Shard, TensorKind, classify, ignored
from preload_daemon.buffers import DTYPES, gc_paused
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError, PlanError
from preload_daemon.safepath import short_repr, short_text
from preload_daemon.safetensors_file import FIX, TensorInfo

ALIGNMENT = 256
FORMAT_VERSION = 2  # 2: quantized TP shards carry the whole weight's scales
COMPONENTS = ("main", "draft")
# Tensor kinds of MTP layers that DeepSeek-V3 checkpoints store as copies of the main model's
# embedding and lm_head: never loaded; a draft variant borrows the main variant's (see store.py).
SHARED_WITH_MAIN = ("mtp_embed", "head")
SHARED_ROLES = ("embedding", "lm_head")


def scheme_params(quantization: str) -> tuple[tuple[str, str], ...]:
    """What the manifest and the cache key record of a scheme besides its name (kernels/formats.py)."""
    return formats.FORMATS[quantization].params if quantization != "none" else ()


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Layout:
    """How one variant of a model version is laid out: its dtype, quantization, TP rank and component."""

    dtype: str = "auto"
    """Target dtype of floating tensors; "auto" keeps config.json's torch_dtype."""
    quantization: str = "none"
    """Scheme for the linear projections (kernels/quant.py), or "none"."""
    tp_size: int = 1
    tp_rank: int = 0
    component: str = "main"
    """"main" for the model, "draft" for its MTP layers."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise PlanError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
        if self.quantization not in SCHEMES:
            raise PlanError(f"unknown quantization scheme {self.quantization!r}; known: {', '.join(SCHEMES)}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise PlanError(f"tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.component not in COMPONENTS:
            raise PlanError(f"unknown component {self.component!r}; choose one of {', '.join(COMPONENTS)}")

    def resolve(self, arch: ArchSpec) -> "Layout":
        """The same layout with "auto" replaced by the dtype it stands for in this model."""
        return dataclasses.replace(self, dtype=str(_target_dtype(arch, self)).removeprefix("torch."))

    def differences(self, other: "Layout") -> list[str]:
        return [f"{f.name} ({getattr(self, f.name)!r} here, {getattr(other, f.name)!r} asked)"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def __str__(self) -> str:
        return f"{self.dtype}/{self.quantization} rank {self.tp_rank}/{self.tp_size} {self.component}"


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
    """Scheme for the linear projections (kernels/quant.py), or "none"."""
    tp_size: int = 1
    tp_rank: int = 0
    component: str = "main"
    """"main" for the model, "draft" for its MTP layers."""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.path.rstrip("/").rsplit("/", 1)[-1])
        self.layout  # checks the layout fields

    @property
    def layout(self) -> Layout:
        return Layout(dtype=self.dtype, quantization=self.quantization, tp_size=self.tp_size, tp_rank=self.tp_rank,
                      component=self.component)

    def with_layout(self, layout: Layout) -> "LoadSpec":
        return dataclasses.replace(self, **dataclasses.asdict(layout))

    @property
    def reads_every_file(self) -> bool:
        """Whether a load of this spec reads (about) every byte of the checkpoint's files: one rank of
        the main model (a TP rank reads its shards, a draft its MTP layers). Such a load has the disk
        read ahead while it plans (Checkpoint's read_ahead)."""
        return self.tp_size == 1 and self.component == "main"


class PlanEntry(typing.NamedTuple):
    """One tensor of the slab, made from one checkpoint tensor (`source`, sliced by `shard`).
    Immutable; a named tuple, as a frozen dataclass takes 1 us to make (a big model has ~90,000)."""

    name: str
    role: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    shard: Shard | None
    source: str
    part: str = ""
    """For quantized weights: "weight", "weight_scale" or "weight_global_scale"."""
    quant_scheme: str = "none"
    quant_params: tuple[tuple[str, str], ...] = ()
    quantize: bool = False
    """Quantized while loading (the parts of one source follow each other); else copied as stored."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan:
    spec: LoadSpec
    arch: ArchSpec
    dtype: torch.dtype
    entries: tuple[PlanEntry, ...]
    total_bytes: int

    @property
    def architecture(self) -> str:
        return self.arch.architecture

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def layout(self) -> Layout:
        """The spec's layout with its dtype resolved: what identifies this variant of a version."""
        return dataclasses.replace(self.spec.layout, dtype=str(self.dtype).removeprefix("torch."))


@gc_paused()
def build_plan(checkpoint: Checkpoint, spec: LoadSpec) -> LoadPlan:
    """The ordered tensors this rank materialises, with aligned slab offsets."""
    arch = ArchSpec.from_config(checkpoint.config, f"{checkpoint.path}/config.json")
    arch.check_tp(spec.tp_size, spec.quantization)
    target = _target_dtype(arch, spec)
    prequantized = _prequantized_scheme(checkpoint)
    if prequantized and spec.quantization != prequantized:
        raise PlanError(f"{checkpoint.path} holds pre-quantized {prequantized} weights (its config.json "
                        f"quantization_config says so); load it with --quantization {prequantized}")

    entries: list[PlanEntry] = []
    offset = 0

    def add(**fields) -> None:
        nonlocal offset
        nbytes = fields["dtype"].itemsize * _numel(fields["shape"])
        entries.append(PlanEntry(offset=offset, nbytes=nbytes, **fields))
        offset = _align(offset + nbytes)

    # Per kind, not per tensor: the expected shape and the shard; per stored dtype, whether it is a
    # float of 16 bits or more (a big model has ~90,000 tensors of a few dozen kinds and shapes).
    expected: dict[str, tuple[int, ...]] = {}
    shards: dict[tuple[str, tuple[int, ...]], Shard | None] = {}
    wide_float: dict[torch.dtype, bool] = {}
    quantized: dict[tuple[int, ...], tuple] = {}
    tensors = checkpoint.tensors
    for name, kind in _component_tensors(checkpoint, arch, spec.component):
        info = tensors[name]
        want = expected.get(kind.key)
        if want is None:
            want = expected[kind.key] = kind.shape(arch)
        if info.shape != want:
            arch.check_shape(name, kind, info.shape)  # raises, naming both shapes
        wide = wide_float.get(info.dtype)
        if wide is None:
            wide = wide_float[info.dtype] = info.dtype.is_floating_point and info.dtype.itemsize > 1
        if not wide and not (prequantized and kind.quantizable):  # _block_scale checks those
            _check_stored_dtype(checkpoint, info, kind)  # raises
        shard_key = (kind.key, info.shape)
        shard = shards.get(shard_key, shards)
        if shard is shards:
            shard = shards[shard_key] = arch.shard(kind, info.shape, spec.tp_size, spec.tp_rank)
        shape = info.shape
        if shard is not None:
            shape = list(shape)
            shape[shard.dim] = shard.length
            shape = tuple(shape)
        if kind.quantizable and spec.quantization != "none":
            stem = name.removesuffix(".weight")
            if prequantized:
                common = dict(role=kind.role, quant_scheme=spec.quantization,
                              quant_params=_quant_params(spec.quantization, shape[1]))
                scale_name, scale_shard, scale_shape = _block_scale(checkpoint, name, shard)
                add(name=name, dtype=info.dtype, shape=shape, shard=shard, source=name, part="weight", **common)
                add(name=f"{stem}.weight_scale", dtype=torch.float32, shape=scale_shape, shard=scale_shard,
                    source=scale_name, part="weight_scale", **common)
                continue
            parts = quantized.get(shape)
            if parts is None:  # once a shape: the manifest's parameters, and each part's dtype, shape and bytes
                parts = quantized[shape] = _quant_params(spec.quantization, shape[1]), tuple(
                    (part, dtype, part_shape, dtype.itemsize * _numel(part_shape))
                    for part, (dtype, part_shape) in quant.layout(spec.quantization, *shape).items())
            params, layout = parts
            for part, dtype, part_shape, nbytes in layout:  # add(), inlined
                entries.append(PlanEntry(f"{stem}.{part}", kind.role, dtype, part_shape, offset, nbytes, shard, name,
                                         part, spec.quantization, params, True))
                offset = (offset + nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            continue
        dtype = target if wide else info.dtype
        nbytes = dtype.itemsize * _numel(shape)
        entries.append(PlanEntry(name, kind.role, dtype, shape, offset, nbytes, shard, name))  # add(), inlined
        offset = (offset + nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    return LoadPlan(spec, arch, target, tuple(entries), max(offset, ALIGNMENT))


def _quant_params(scheme: str, in_features: int) -> tuple[tuple[str, str], ...]:
    """The manifest's parameters of a weight quantized with `scheme`."""
    return tuple(sorted({**dict(scheme_params(scheme)), "in_features": str(in_features)}.items()))


def _prequantized_scheme(checkpoint: Checkpoint) -> str | None:
    """The scheme a checkpoint's weights are already stored in, from config.json."""
    config = checkpoint.config.get("quantization_config")
    if not config:
        return None
    if not isinstance(config, dict):
        raise CheckpointError(f"{checkpoint.path}/config.json: quantization_config must be an object, got "
                              f"{short_repr(config)}; fix or re-export the config")
    method, block = config.get("quant_method"), config.get("weight_block_size")
    if method == "fp8" and block == [quant.FP8_BLOCK, quant.FP8_BLOCK]:
        return "fp8_block"
    raise CheckpointError(f"{checkpoint.path}: quantization_config {short_repr(method)} with weight_block_size "
                          f"{short_repr(block)} is not supported; pre-quantized checkpoints must be FP8 with "
                          "weight_block_size [128, 128]")


def _check_stored_dtype(checkpoint: Checkpoint, info: TensorInfo, kind: TensorKind) -> None:
    """Weights are floats of 16 bits or more (8-bit floats only with their scales, in a pre-quantized
    checkpoint): an integer or bool tensor where a weight belongs would be copied as stored and only
    fail in the engine, after the load succeeded."""
    if not info.dtype.is_floating_point or info.dtype.itemsize < 2:
        raise CheckpointError(f"{_where(checkpoint, info)}: tensor {short_repr(info.name)} is stored as "
                              f"{str(info.dtype).removeprefix('torch.')}, but a {kind.role} weight must be float16, "
                              "bfloat16, float32 or float64 (8-bit floats only in a pre-quantized checkpoint whose "
                              f"config.json has a quantization_config); {FIX}")


def _where(checkpoint: Checkpoint, info: TensorInfo) -> str:
    """The file holding a tensor, for messages (a streamed checkpoint has none)."""
    return str(info.file) if info.file.name else str(checkpoint.path)


def _file_set(checkpoint: Checkpoint) -> str:
    """The files a checkpoint's tensors came from, for messages."""
    files = sorted({info.file.name for info in checkpoint.tensors.values() if info.file.name})
    if not files:
        return str(checkpoint.path)
    shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return f"{checkpoint.path} ({shown})"


def _block_scale(checkpoint: Checkpoint, name: str, shard: Shard | None):
    """(source name, shard, shape) of a pre-quantized weight's 128x128 block scales."""
    scale_name = name + "_scale_inv"
    info = checkpoint.tensors.get(scale_name)
    if info is None or checkpoint.tensors[name].dtype != torch.float8_e4m3fn or not info.dtype.is_floating_point:
        raise CheckpointError(f"{checkpoint.path}: pre-quantized {name!r} needs float8_e4m3fn data and a "
                              f"floating-point {scale_name!r} tensor; re-export the checkpoint")
    block = quant.FP8_BLOCK
    expected = tuple(-(-d // block) for d in checkpoint.tensors[name].shape)
    if tuple(info.shape) != expected:
        raise CheckpointError(f"{checkpoint.path}: {scale_name!r} has shape {short_repr(list(info.shape))}, expected "
                              f"{list(expected)} for 128x128 blocks")
    if shard is None:
        return scale_name, None, tuple(info.shape)
    if shard.start % block or shard.length % block:
        raise PlanError(f"{checkpoint.path}: TP shard of {name!r} ({shard.length} from {shard.start}) does not fall on "
                        "128-element block boundaries; use a smaller --tp-size")
    scale_shard = Shard(shard.dim, shard.start // block, shard.length // block)
    scale_shape = list(info.shape)
    scale_shape[shard.dim] = scale_shard.length
    return scale_name, scale_shard, tuple(scale_shape)


def _target_dtype(arch: ArchSpec, spec) -> torch.dtype:
    if spec.dtype != "auto":
        return DTYPES[spec.dtype]
    name = arch.torch_dtype or "bfloat16"
    if name not in DTYPE_CHOICES[1:]:
        raise CheckpointError(f"{arch.source}: torch_dtype {short_repr(name)} is not one of "
                              f"{', '.join(DTYPE_CHOICES[1:])}; pass --dtype explicitly")
    return DTYPES[name]


def _component_tensors(checkpoint: Checkpoint, arch: ArchSpec, component: str) -> list[tuple[str, TensorKind]]:
    """(name, kind) of the component's tensors in a stable order: MTP layers (index >=
    num_hidden_layers) belong to the draft, everything else to the main model. A tensor no kind
    matches, or of a layer the config has not, is refused, and so is a main component that lacks a
    tensor the config needs."""
    known, unknown, beyond = [], [], []
    for name in checkpoint.tensors:
        if ignored(name) or name.endswith(".weight_scale_inv"):  # scales are planned with their weight
            continue
        found = classify(name)
        if found is None:
            unknown.append(name)
            continue
        kind, layer = found
        is_draft = layer is not None and layer >= arch.num_layers
        if layer is not None and layer >= arch.num_layers + arch.num_mtp_layers:
            beyond.append(name)  # dropped unseen before: a 30-layer model ran on 29 (or 1) of its layers
        elif kind.mtp and not is_draft:
            unknown.append(name)
        elif kind.key in SHARED_WITH_MAIN:
            continue  # an MTP layer's copy of the embedding or lm_head: the draft uses the main one's
        elif is_draft == (component == "draft"):
            known.append((-1 if layer is None else layer, name, kind))
    if unknown:
        raise CheckpointError(f"{checkpoint.path}: {len(unknown)} tensor(s) of no kind {arch.architecture} has, e.g. "
                              f"{', '.join(map(short_text, sorted(unknown)[:3]))}; is config.json's architecture "
                              "right?")
    if beyond:
        raise CheckpointError(f"{checkpoint.path}: {len(beyond)} tensor(s) of layers past config.json's "
                              f"num_hidden_layers ({arch.num_layers}) and num_nextn_predict_layers "
                              f"({arch.num_mtp_layers}), e.g. {', '.join(map(short_text, sorted(beyond)[:3]))}; "
                              "config.json does not belong to these weights")
    if component == "main":
        # A required name present is among `known`: it is its kind's template (so classified as that
        # kind) in a main layer, and no required kind is skipped above.
        missing = [n for n in arch.required() if n not in checkpoint.tensors]
        # An MTP layer the config declares has its own kinds: else config.json's num_hidden_layers
        # is short, and the main model would run on its first layers alone.
        mtp_layer = KIND["eh_proj"].template
        missing += [name for i in range(arch.num_layers, arch.num_layers + arch.num_mtp_layers)
                    if (name := mtp_layer.replace("{layer}", str(i))) not in checkpoint.tensors]
        if missing:
            raise CheckpointError(f"{_file_set(checkpoint)}: {len(missing)} tensor(s) that config.json needs are "
                                  f"missing, e.g. {', '.join(missing[:3])}; the checkpoint is incomplete (copy or "
                                  "download all of its files), or config.json does not belong to it")
    elif not known:
        raise PlanError(f"{checkpoint.path}: component 'draft' asked for, but the checkpoint has no MTP layers "
                        "(num_nextn_predict_layers is 0 or absent)")
    # By (layer, name): names are unique, so the kinds are never compared.
    return [(name, kind) for _, name, kind in sorted(known)]


def _numel(shape) -> int:
    return math.prod(shape)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
