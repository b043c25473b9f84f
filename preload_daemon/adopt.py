"""Crash recovery: a daemon that starts on a device adopts the host slabs a previous daemon left.

Beside each sealed slab (`NAME.slab`) the daemon writes a record (`NAME.slab.json`): the model,
version and layout the slab holds, its tensor table, its digest and where its weights came from.
Each device's model pointers (active version, last number given out, retention, pins) are kept in
`state-DEVICE.json`. Both are written atomically (a temporary file, then rename) in the private
shared-memory directory, and live as long as the slabs do (until reboot).

A new daemon on the device reads them, re-hashes every slab against its record's digest, and
installs what checks out as the versions and variants they were, without reading any checkpoint.
Anything partial or corrupt (a slab without a record: a load that did not finish; a record that
does not parse, names another size, or whose slab's bytes changed) is discarded and reported.
Leases are not adopted: engines re-register theirs with the new daemon. JSON only, no pickle.
"""

import dataclasses
import json
import logging
import os
import pathlib
import stat
import time

from preload_daemon.arch import ArchSpec
from preload_daemon.buffers import dtype_from_name
from preload_daemon.errors import InvalidRequestError
from preload_daemon.hfconfig import parse_config
from preload_daemon.plan import Layout, LoadPlan, LoadSpec, PlanEntry
from preload_daemon.records import MAX_VERSION, Model, Variant, Version, check_name, key_for
from preload_daemon.safetensors_file import FileIdentity
from preload_daemon.slab import HostSlab, SlabGoneError

log = logging.getLogger(__name__)
RECORD_FORMAT = 1
MAX_RECORD_BYTES = 256 << 20  # a tensor table of ~1M entries
RECORD_SUFFIX = ".json"


def device_tag(device: str) -> str:
    """The prefix of a device's slab names ("cpu0"): a daemon only adopts or sweeps its own."""
    return device.replace(":", "")


def state_path(shm_dir: pathlib.Path, device: str) -> pathlib.Path:
    return shm_dir / f"state-{device_tag(device)}.json"


def write_record(variant: Variant) -> None:
    """The record beside a freshly sealed slab."""
    version, plan, slab = variant.version, variant.plan, variant.slab
    record = {
        "format": RECORD_FORMAT, "slab": slab.path.name, "size": slab.size, "digest": slab.digest,
        "model": version.model.name, "version": version.number, "source": version.source,
        "files": [dataclasses.asdict(f) for f in version.files], "config_json": version.config_json,
        "created_at": version.created_at, "layout": dataclasses.asdict(variant.layout),
        "dtype": str(plan.dtype).removeprefix("torch."), "loaded_at": variant.loaded_at,
        "load_seconds": variant.load_seconds, "total_bytes": plan.total_bytes,
        "entries": [[e.name, e.role, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset, e.nbytes, e.part,
                     e.quant_scheme, [list(p) for p in e.quant_params]] for e in plan.entries],
    }
    _write_atomic(slab.path.with_name(slab.path.name + RECORD_SUFFIX), json.dumps(record).encode())


def write_state(shm_dir: pathlib.Path, device: str, models: list[Model]) -> None:
    """The device's model pointers, rewritten after every change."""
    state = {"format": RECORD_FORMAT, "device": device, "models": [
        {"name": m.name, "active": m.active, "last": m.last, "keep": m.keep, "max_bytes": m.max_bytes,
         "pinned": sorted(n for n, v in m.versions.items() if v.pinned)} for m in models]}
    _write_atomic(state_path(shm_dir, device), json.dumps(state).encode())


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:  # writes it all, or raises (a full /dev/shm)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclasses.dataclass
class Adopted:
    models: dict[str, Model]
    report: list[str]
    seconds: float
    bytes: int


def adopt(shm_dir: pathlib.Path, device: str) -> Adopted:
    """Everything of `device` that a previous daemon left in `shm_dir`: the models it can rebuild
    (versions and variants, no leases) and a line per slab adopted or discarded. Discarded slabs
    and records are deleted."""
    started = time.monotonic()
    tag = device_tag(device) + "-"
    report: list[str] = []
    if not shm_dir.is_dir():
        return Adopted({}, report, 0.0, 0)
    state = _read_state(shm_dir, device, report)
    models: dict[str, Model] = {}
    slabs = sorted(p for p in shm_dir.iterdir() if p.name.startswith(tag) and p.name.endswith(".slab"))
    records = {p for p in shm_dir.iterdir() if p.name.startswith(tag) and p.name.endswith(".slab" + RECORD_SUFFIX)}
    adopted_bytes = 0
    drafts: list[tuple[Variant, Layout]] = []
    for path in slabs:
        record_path = path.with_name(path.name + RECORD_SUFFIX)
        records.discard(record_path)
        try:
            variant = _adopt_one(path, record_path, models, state)
        except _Discard as e:
            report.append(f"discarded {path.name}: {e}")
            log.warning("discarding slab %s: %s", path.name, e)
            _remove(path, record_path)
            continue
        adopted_bytes += variant.slab.size
        if variant.layout.component == "draft":
            drafts.append((variant, dataclasses.replace(variant.layout, component="main")))
        report.append(f"adopted {variant.name} v{variant.version.number} ({variant.layout}): "
                      f"{variant.slab.size / 2**20:.1f} MiB, digest checked")
    for variant, main in drafts:  # a draft borrows its main variant's embedding and lm_head
        variant.base = variant.version.variants.get(main)
        if variant.base is None:
            report.append(f"discarded {variant.slab.path.name}: its main variant ({main}) was not adopted")
            variant.version.variants.pop(variant.layout)
            adopted_bytes -= variant.slab.size
            variant.slab.close()
            _remove(variant.slab.path, variant.slab.path.with_name(variant.slab.path.name + RECORD_SUFFIX))
    for orphan in sorted(records):
        report.append(f"discarded {orphan.name}: a record without its slab")
        _remove(orphan)
    for pattern in (f".{tag}*.tmp", f".{state_path(shm_dir, device).name}.*.tmp"):
        for torn in shm_dir.glob(pattern):  # a record or state write the crash cut short
            _remove(torn)
    for name, model in list(models.items()):
        for number in [n for n, v in model.versions.items() if not v.variants]:
            del model.versions[number]
        if not model.versions:
            del models[name]
            continue
        _restore_pointers(model, state.get(name, {}))
    for name, saved in state.items():  # every version evicted: the numbers given out are still never reused
        if name not in models and saved["last"]:  # (_saved_pointers checked its range)
            try:
                check_name(name)
            except InvalidRequestError:
                continue
            model = models[name] = Model(name)
            model.last, model.keep, model.max_bytes = saved["last"], saved["keep"], saved["max_bytes"]
    return Adopted(models, report, time.monotonic() - started, adopted_bytes)


def _remove(*paths: pathlib.Path) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # a directory planted at the name, say: reported, never fatal
            log.warning("cannot remove %s: %s", path, e)


class _Discard(Exception):
    pass


def _adopt_one(path: pathlib.Path, record_path: pathlib.Path, models: dict[str, Model], state: dict) -> Variant:
    if not os.path.lexists(record_path):
        raise _Discard("no record beside it (a load that did not finish)")
    record = _read_json(record_path, "its record")
    try:
        layout = Layout(**record["layout"])
        number = int(record["version"])
        if record.get("format") != RECORD_FORMAT or record["slab"] != path.name or not 0 < number <= MAX_VERSION:
            raise _Discard("its record is of another format or names another slab")
        entries = tuple(PlanEntry(name=n, role=role, dtype=dtype_from_name(dt), shape=tuple(int(d) for d in shape),
                                  offset=int(offset), nbytes=int(nbytes), shard=None, source=n, part=part,
                                  quant_scheme=scheme, quant_params=tuple((str(k), str(v)) for k, v in params))
                        for n, role, dt, shape, offset, nbytes, part, scheme, params in record["entries"])
        files = tuple(FileIdentity(**f) for f in record["files"])
        name, size, digest, source = str(record["model"]), int(record["size"]), str(record["digest"]), \
            str(record["source"])
        check_name(name)
        arch = ArchSpec.from_config(parse_config(record["config_json"], source), source)
        dtype = dtype_from_name(record["dtype"])
        created_at, loaded_at = float(record["created_at"]), float(record["loaded_at"])
        load_seconds, total_bytes = float(record["load_seconds"]), int(record["total_bytes"])
        plan = LoadPlan(LoadSpec(path=source, name=name, **dataclasses.asdict(layout)), arch, dtype, entries,
                        total_bytes)
    except _Discard:
        raise
    except Exception as e:  # whatever a damaged record holds
        raise _Discard(f"its record does not parse ({type(e).__name__}: {str(e)[:200]})") from None
    if size <= 0 or total_bytes != size or any(e.offset + e.nbytes > size for e in entries):
        raise _Discard("its record's sizes do not fit the slab")
    model = models.setdefault(name, Model(name))
    version = model.versions.get(number)
    if version is not None and layout in version.variants:
        raise _Discard(f"{name} v{number} ({layout}) was adopted from another slab already")
    slab = _open_slab(path, size, digest)
    if version is None:
        version = model.versions[number] = Version(model, number, source, files, record["config_json"], arch,
                                                   created_at)
        version.pinned = number in state.get(name, {}).get("pinned", [])
    variant = Variant(version, plan.layout, plan, key_for(files, plan, digest), slab, loaded_at, load_seconds)
    version.variants[variant.layout] = variant
    return variant


def _open_slab(path: pathlib.Path, size: int, digest: str) -> HostSlab:
    """The slab, mapped read-only, if it is a regular file of ours of the recorded size whose
    bytes still hash to the recorded digest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _Discard(f"cannot open it ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise _Discard("it is not a regular file of this user")
        if info.st_size != size:
            raise _Discard(f"it has {info.st_size} bytes, its record says {size}")
        slab = HostSlab.open(path, size, digest, fd)
    except OSError as e:
        raise _Discard(f"cannot map it ({e.strerror or e})") from None
    finally:
        os.close(fd)
    try:
        actual = slab.hash()
    except SlabGoneError as e:  # cut short behind the daemon's back while it was read
        slab.close()
        raise _Discard(f"its file was {e.reason} while it was hashed") from None
    if actual != digest:
        slab.close()
        raise _Discard(f"its bytes changed after it was sealed (digest {actual}, sealed as {digest})")
    return slab


def _read_state(shm_dir: pathlib.Path, device: str, report: list[str]) -> dict[str, dict]:
    path = state_path(shm_dir, device)
    if not path.exists():
        return {}
    try:
        models = _read_json(path, "the state file")["models"]
        if not isinstance(models, list):
            raise ValueError("its models are not a list")
    except Exception as e:
        report.append(f"ignored {path.name}: {e} (active versions default to the newest adopted)")
        return {}
    saved = {}
    for m in models:
        try:
            saved[str(m["name"])] = _saved_pointers(m)
        except Exception as e:  # one model's record: the others' still count
            report.append(f"ignored {str(m.get('name', '?'))[:80]!r} in {path.name}: {e} (its active version "
                          "defaults to the newest adopted)" if isinstance(m, dict) else f"ignored an entry of "
                          f"{path.name}: not an object")
    return saved


def _saved_pointers(m: dict) -> dict:
    """One model's record of the state file, each number in the range the daemon itself would give
    it (a last of 2**33 or a negative keep, adopted, failed every GetStats after)."""
    def number(key: str, low: int, high: int) -> int:
        value = m[key]
        if type(value) is not int or not low <= value <= high:
            raise ValueError(f"{key} {str(value)[:40]} is not an integer in [{low}, {high}]")
        return value

    pinned = m["pinned"]
    if not isinstance(pinned, list) or not all(type(n) is int and 1 <= n <= MAX_VERSION for n in pinned):
        raise ValueError(f"pinned is not a list of versions in [1, {MAX_VERSION}]")
    return {"active": number("active", 0, MAX_VERSION), "last": number("last", 0, MAX_VERSION),
            "keep": number("keep", 0, MAX_VERSION), "max_bytes": number("max_bytes", 0, 2**63 - 1),
            "pinned": list(pinned)}


def _read_json(path: pathlib.Path, what: str):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _Discard(f"cannot open {what}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > MAX_RECORD_BYTES:
            raise _Discard(f"{what} is not a regular file of this user under {MAX_RECORD_BYTES} bytes")
        data = f.read(MAX_RECORD_BYTES + 1)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise _Discard(f"{what} is not valid JSON ({type(e).__name__})") from None


def _restore_pointers(model: Model, saved: dict) -> None:
    numbers = sorted(model.versions)
    model.last = max(saved.get("last", 0), numbers[-1])
    model.keep = saved.get("keep", model.keep)
    model.max_bytes = saved.get("max_bytes", model.max_bytes)
    active = saved.get("active", 0)
    model.active = active if active in model.versions else numbers[-1]
