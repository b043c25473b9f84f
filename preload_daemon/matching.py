"""Which model and version a request means: the version it numbers, the one loaded from the
checkpoint files the caller has (never one whose files changed on disk since it was loaded), or the
active one; and which version a load or publish goes into."""

from preload_daemon.cachekey import file_differences
from preload_daemon.checkpoint import refresh_identity
from preload_daemon.errors import InvalidRequestError, LoadingError, NotFoundError, StaleError, VersionTakenError
from preload_daemon.records import Model, Version, check_name, check_new_name, check_number, common_dir
from preload_daemon.safetensors_file import FileIdentity


def find_model(models: dict[str, Model], name: str, device: str, create: bool = False) -> Model:
    """The model called `name` in `models` (created if `create`), or an error listing the models
    there are (caller holds the store's lock)."""
    check_name(name)
    model = models.get(name)
    if model is None:
        if not create:
            loaded = ", ".join(sorted(n for n, m in models.items() if m.versions)) or "none"  # not failed loads
            raise NotFoundError(f"model {name!r} is not loaded on {device} (loaded: {loaded}); "
                                f"load it with `preload serve`")
        check_new_name(name)
        model = models[name] = Model(name)
    return model


def find_version(model: Model, number: int, device: str) -> Version:
    """Version `number` of `model`, or an error listing the versions there are (caller holds the
    store's lock)."""
    version = model.versions.get(number)
    if version is None:
        have = ", ".join(f"v{n}" for n in sorted(model.versions)) or "none"
        freed = " (it was freed)" if 0 < number <= model.last else ""
        raise NotFoundError(f"{model.name} has no version {number} on {device}{freed}; versions: {have}")
    return version


def version_for(model: Model, files: tuple[FileIdentity, ...], number: int, device: str) -> Version | int:
    """The version loaded from these files (as they are now), or the number a new one gets (caller
    holds the store's lock)."""
    same = [v for v in model.versions.values() if v.files and not file_differences(v.files, files)]
    if number and number in model.versions and model.versions[number] not in same:
        raise VersionTakenError(f"{model.name} v{number} exists on {device} with other weights "
                                f"(from {model.versions[number].source}); publish as v{model.last + 1} or later")
    if number and number not in model.versions and number <= model.last:
        raise VersionTakenError(f"{model.name} v{number} was used before on {device} (numbers are "
                                f"never reused); publish as v{model.last + 1} or later")
    if same:
        return max(same, key=lambda v: v.number)
    return check_number(model, number or model.last + 1)


def new_number(model: Model, number: int, device: str) -> int:
    """The number a published version gets: `number`, or else the next; never one used before
    (caller holds the store's lock)."""
    number = check_number(model, number or model.last + 1)
    if number in model.versions or number <= model.last:
        raise VersionTakenError(f"{model.name} v{number} was used before on {device}; publish "
                                f"as v{model.last + 1} or later")
    return number


def pick_version(model: Model, number: int, files: tuple[FileIdentity, ...], device: str, lock,
                 on_change) -> Version:
    """The version an attach means: `number` if given, else the one loaded from `files`, else the
    active one. Holds `lock` (the store's) while reading the model, not while checking files."""
    name = model.name
    with lock:
        if not model.versions and model.failures and not model.load_lock.locked():
            raise NotFoundError(f"{name} has no version on {device}; its last load failed: "
                                f"v{model.failures[0]}")
        if number:
            return find_version(model, number, device)
        if not files:
            if model.active not in model.versions:
                raise LoadingError(f"{name} has no active version on {device} yet; it is still loading")
            return model.versions[model.active]
        candidates = sorted((v for v in model.versions.values() if v.files), key=lambda v: -v.number)
    for v in candidates:
        if not file_differences(v.files, files):
            check_fresh(v, device, on_change)
            return v
    wanted = {f.path for f in files}
    for v in candidates:
        if {f.path for f in v.files} == wanted:  # the same files, changed since
            check_fresh(v, device, on_change)
            raise StaleError(f"{name} v{v.number} on {device} was loaded from these files, but they "
                             f"differ now: {', '.join(file_differences(v.files, files))}; load them again with "
                             f"`preload serve {v.source}` (or `preload publish {name} --from DIR`)")
    versions = ", ".join(f"v{v.number} from {v.source}" for v in sorted(model.versions.values(),
                                                                      key=lambda v: v.number)) or "none"
    raise NotFoundError(f"no version of {name} on {device} was loaded from the caller's checkpoint files "
                        f"({len(files)} file(s) in {common_dir(files)}); versions: {versions}. Load it with "
                        "`preload serve DIR`, or attach by version (--weights-version)")


def check_fresh(version: Version, device: str, on_change) -> None:
    """Marks a version stale when its checkpoint files changed on disk since it was loaded: no
    variant may be loaded from them as this version any more, and no caller is matched to it by
    files. Its slabs still hold its weights: attaching by version number keeps working. Calls
    `on_change` when it marks one."""
    if mark_stale(version):
        on_change()
    if version.stale_reason:
        raise StaleError(f"{version.model.name} v{version.number} on {device} is stale "
                         f"({version.stale_reason}); load it again with `preload serve {version.source}`")


def mark_stale(version: Version) -> bool:
    """Sets the version's stale_reason if its checkpoint files changed on disk since it was loaded
    (a stat of each file); True if it was marked just now."""
    if not version.files or version.stale_reason:
        return False
    diffs = file_differences(refresh_identity(version.files), version.files)
    if diffs:
        version.stale_reason = f"checkpoint changed on disk since it was loaded: {', '.join(diffs)}"
    return bool(diffs)
