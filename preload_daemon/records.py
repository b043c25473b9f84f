"""The store's records: a model name, its versions and their variants, with the rules that decide
which versions retention and the byte budget may free. Plain data and pure functions: the locking,
loading and slab handling are the store's (store.py)."""

import collections
import dataclasses
import threading

from preload_daemon.arch import ArchSpec
from preload_daemon.cachekey import CacheKey
from preload_daemon.errors import BudgetError, InvalidRequestError, NotFoundError, StaleError
from preload_daemon.leases import Lease
from preload_daemon.plan import FORMAT_VERSION, Layout, LoadPlan, scheme_params
from preload_daemon.safetensors_file import FileIdentity
from preload_daemon.slab import Slab, slab_gone

DEFAULT_KEEP = 2
MAX_FAILURES = 16
MAX_VERSION = 2**31 - 1


@dataclasses.dataclass(slots=True)
class LoadProgress:
    stage: str
    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    keep: int | None = None
    """Newest unpinned, unleased, inactive versions kept; None leaves the model's setting."""
    max_bytes: int | None = None
    """Budget of all the model's versions on this device; 0 means none; None leaves the setting."""


@dataclasses.dataclass(eq=False, slots=True)
class Variant:
    """One layout of one version: a slab and the plan that filled it."""

    version: "Version"
    layout: Layout
    """With the dtype resolved."""
    plan: LoadPlan
    key: CacheKey
    slab: Slab
    loaded_at: float
    load_seconds: float
    leases: dict[str, Lease] = dataclasses.field(default_factory=dict)
    base: "Variant | None" = None
    """A draft's main variant (same dtype, scheme and rank), whose embedding and lm_head it shares
    by reference instead of holding copies."""
    wire_manifest: bytes | None = None
    """Its serialized manifest, as sent to attaching clients: built on the first attach
    (wire.manifest_bytes); a variant never changes once sealed."""
    damaged: str = ""
    """What `preload verify` found wrong with its slab (bytes changed since sealed, its file
    truncated): it is handed out no more."""

    @property
    def name(self) -> str:
        return self.version.model.name


@dataclasses.dataclass(eq=False, slots=True)
class Version:
    model: "Model"
    number: int
    source: str
    """The checkpoint directory, or "stream:LABEL" for a version a live process published."""
    files: tuple[FileIdentity, ...]
    """The checkpoint files as loaded (empty for a streamed version)."""
    config_json: str
    arch: ArchSpec
    created_at: float
    variants: dict[Layout, Variant] = dataclasses.field(default_factory=dict)
    pinned: bool = False
    loading: int = 0
    """Loads adding variants right now."""
    creating: bool = False
    """The load that makes this version has not finished: it may still fail and free every variant,
    so none is attached and the version is not activated until it does."""
    stale_reason: str = ""

    @property
    def state(self) -> str:
        if self.creating:
            return "loading"
        if any(v.damaged for v in self.variants.values()):
            return "damaged"
        return "stale" if self.stale_reason else "ready"

    @property
    def bytes(self) -> int:
        return sum(v.slab.size for v in self.variants.values())

    @property
    def num_leases(self) -> int:
        return sum(len(v.leases) for v in self.variants.values())


@dataclasses.dataclass(eq=False, slots=True)
class Model:
    name: str
    versions: dict[int, Version] = dataclasses.field(default_factory=dict)
    active: int = 0
    last: int = 0
    """The highest version number given out: numbers are never reused, even after eviction."""
    keep: int = DEFAULT_KEEP
    max_bytes: int = 0
    failures: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=MAX_FAILURES))
    load_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Loads of one model run one at a time, so two never create the same version twice."""

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.versions.values())


def evictable(model: Model, protect: Version | None = None) -> list[Version]:
    """Versions retention may free, newest first: not active, pinned, leased or loading."""
    return sorted((v for v in model.versions.values() if v.number != model.active and not v.pinned
                   and not v.num_leases and not v.loading and v is not protect), key=lambda v: -v.number)


def budget_victims(model: Model, needed: int, target: Version) -> list[Version]:
    """The oldest evictable versions to free so that `needed` more bytes fit the model's budget;
    BudgetError naming what is kept and why when they cannot be found."""
    if not needed or not model.max_bytes or model.bytes + needed <= model.max_bytes:
        return []
    victims, held = [], model.bytes
    for version in reversed(evictable(model, protect=target)):
        if held + needed <= model.max_bytes:
            break
        victims.append(version)
        held -= version.bytes
    if needed > model.max_bytes:
        raise BudgetError(f"{model.name} needs {needed / 2**20:.1f} MiB, more than its whole budget "
                          f"(--max-bytes {model.max_bytes}); raise --max-bytes, or 0 for no budget")
    if held + needed > model.max_bytes:
        kept = ", ".join(f"v{v.number} ({why_kept(model, v)}, {v.bytes / 2**20:.1f} MiB)"
                         for v in sorted(model.versions.values(), key=lambda v: v.number) if v not in victims)
        raise BudgetError(f"{model.name} needs {needed / 2**20:.1f} MiB more, but its budget "
                          f"(--max-bytes {model.max_bytes}) holds {model.bytes / 2**20:.1f} MiB that cannot be "
                          f"freed: {kept or 'nothing'}; unpin or release versions, or raise --max-bytes")
    return victims


def pick_variant(version: Version, layout: Layout | None, device: str) -> Variant:
    """The variant with `layout` (dtype "auto" resolved against the version), else the version's
    first main variant; StaleError naming the closest layout and what there is."""
    variants = list(version.variants.values())
    if layout is None:
        main = [v for v in variants if v.layout.component == "main"] or variants
        if not main:
            raise NotFoundError(f"{version.model.name} v{version.number} has no variants on {device}")
        return main[0]
    wanted = layout.resolve(version.arch)
    found = version.variants.get(wanted)
    if found is not None:
        return found
    closest = min(variants, key=lambda v: len(v.layout.differences(wanted)), default=None)
    have = "; ".join(str(v.layout) for v in variants) or "none"
    diffs = f" (closest differs in {', '.join(closest.layout.differences(wanted))})" if closest else ""
    raise StaleError(f"{version.model.name} v{version.number} on {device} has no variant {wanted}{diffs}; "
                     f"it has: {have}. Load that layout with `preload serve` (same --dtype, --quantization, "
                     "--tp-size as the engine)")


def key_for(files: tuple[FileIdentity, ...], plan: LoadPlan, content_digest: str = "") -> CacheKey:
    """The cache key of a variant: its source files, its plan's layout and the digest of its bytes."""
    spec = plan.spec
    return CacheKey(files=tuple(files), architecture=plan.architecture, tp_size=spec.tp_size,
                    tp_rank=spec.tp_rank, dtype=str(plan.dtype).removeprefix("torch."),
                    quantization=spec.quantization, component=spec.component, format_version=FORMAT_VERSION,
                    quant_params=scheme_params(spec.quantization),
                    content_digest=content_digest)


def check_number(model: Model, number: int) -> int:
    if not 0 < number <= MAX_VERSION:
        hint = f"publish as v{model.last + 1} (the next) instead" if model.last < MAX_VERSION else \
            f"every number of {model.name} was used: publish under a new name"
        raise InvalidRequestError(f"version {number} of {model.name} is out of range (1..{MAX_VERSION}); {hint}")
    return number


def unique_plans(plans: list[LoadPlan]) -> list[LoadPlan]:
    """One plan per resolved layout (["auto", "float32"] on a float32 model are one variant)."""
    first: dict[Layout, LoadPlan] = {}
    for plan in plans:
        first.setdefault(plan.layout, plan)
    return list(first.values())


def why_kept(model: Model, version: Version) -> str:
    if version.number == model.active:
        return "active"
    if version.pinned:
        return "pinned"
    if version.num_leases:
        pids = sorted({lease.pid for var in version.variants.values() for lease in var.leases.values()})
        return f"leased by pid {', '.join(map(str, pids))}"
    return "loading" if version.loading else "being loaded"


def common_dir(files: tuple[FileIdentity, ...]) -> str:
    dirs = sorted({f.path.rsplit("/", 1)[0] for f in files})
    return dirs[0] if len(dirs) == 1 else f"{len(dirs)} directories"


def check_name(name: str) -> None:
    if not name or len(name) > 256 or not name.isprintable():
        raise InvalidRequestError(f"model name {name[:80]!r} must be 1..256 printable characters (no NUL, line "
                                  "breaks or other control characters)")


def check_new_name(name: str) -> None:
    """The stricter rules for a name a load creates: one a user can type back (`MODEL@N` splits at
    the last '@'). Names already held (adopted from an older daemon) need only check_name."""
    check_name(name)
    if "@" in name or name != name.strip():
        raise InvalidRequestError(f"model name {name!r} has an '@' or spaces at an end, which `preload evict "
                                  "MODEL@N` and the other commands could not name back; give another with --name")


def check_slab_files(variant: Variant, device: str) -> None:
    """Refuses to hand out a variant whose slab files were deleted, replaced or resized behind the
    daemon's back (an `rm` in /dev/shm, logind's RemoveIPC at logout), or whose bytes `preload verify`
    found changed: engines attached keep their mapping, a new one could not map the file, or would
    read what someone wrote there."""
    version = variant.version
    fix = f"`preload evict {variant.name}@{version.number} --force`, then load it again"
    for v in {id(v): v for v in (variant, variant.base) if v is not None}.values():
        if v.damaged:
            raise NotFoundError(f"{variant.name} v{version.number} on {device} is damaged ({v.damaged}), and is not "
                                f"handed out any more; engines attached keep what they mapped: {fix}")
        if gone := slab_gone(v.slab):
            raise NotFoundError(f"the slab file of {variant.name} v{version.number} on {device} ({v.slab.path}) was "
                                f"{gone} behind the daemon's back; engines attached keep their mapping, new ones "
                                f"cannot attach: {fix}")
