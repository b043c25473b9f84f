"""Versions across the daemons of a runtime directory: publish (from a directory or a live process),
roll back, pin. A model served with TP N lives on N daemons, one per device, each holding its
rank's variants; a publish loads the new version on every one of them beside the old, and moves
each pointer only once all are ready. If any rank fails, the new version is freed everywhere and
the active one never stopped serving. Used by `preload serve/publish/rollback/pin` and by trainers
(`publish_tensors`)."""

import dataclasses
import logging
import os
import pathlib
import random
import sys
import threading
import time
from collections.abc import Callable

from preload_daemon.cachekey import file_differences, file_identity
from preload_daemon.checkpoint import stat_identity
from preload_daemon.client import DaemonClient
from preload_daemon.config import default_runtime_dir
from preload_daemon.errors import (AccessDeniedError, CheckpointError, DaemonUnavailableError, InvalidRequestError,
                                   NotFoundError, PreloadError, VersionTakenError)
from preload_daemon.plan import Layout, LoadSpec
from preload_daemon.runtime_dir import check_runtime_dir, socket_abandoned
from protos import preload_pb2 as pb

log = logging.getLogger(__name__)

PUBLISH_TRIES = 5


@dataclasses.dataclass(slots=True)
class Published:
    version: int
    created: bool
    """False when the files were already loaded as `version` (which is active now all the same)."""
    variants: list[list[pb.ModelInfo]]
    """Each target's variants, in the targets' order."""


@dataclasses.dataclass(slots=True)
class Target:
    """One daemon taking part in a publish, and the variants it builds there."""

    device: str
    layouts: list[Layout]


def daemon_sockets(runtime_dir: pathlib.Path, stale: list | None = None) -> list[tuple[str, pathlib.Path]]:
    """(device, socket) for every daemon socket in the runtime dir that something listens on; those a
    dead daemon left behind are skipped, and listed in `stale` if given.
    AccessDeniedError if the directory is another user's (whose daemons we may not use)."""
    runtime_dir = pathlib.Path(runtime_dir)
    check_runtime_dir(runtime_dir)
    if runtime_dir.is_dir() and not os.access(runtime_dir, os.R_OK | os.X_OK):
        owner = runtime_dir.stat().st_uid
        raise AccessDeniedError(f"permission denied: {runtime_dir} is private to uid {owner} (its daemons serve that "
                                f"user), and you are uid {os.getuid()}; run your own daemon with `preload daemon`, or "
                                "set PRELOAD_RUNTIME_DIR to a directory of your own")
    found = []
    for path in sorted(runtime_dir.glob("daemon-*.sock")):
        kind, _, index = path.stem.removeprefix("daemon-").partition("-")
        device = f"{kind}:{index}"
        if not socket_abandoned(path):
            found.append((device, path))
        elif stale is not None:
            stale.append((device, path))
    return found


def holders(name: str, runtime_dir: pathlib.Path) -> dict[str, pb.Stats]:
    """{device: stats} of the daemons that know `name` (any version, or a failed load)."""
    found = {}
    for device, path in daemon_sockets(runtime_dir):
        with DaemonClient(path, timeout=5.0) as client:
            try:
                stats = client.stats()
            except DaemonUnavailableError as e:  # it listens: whether it holds `name` is unknown
                raise DaemonUnavailableError(f"daemon {device} does not answer, so whether it holds {name!r} is "
                                             f"unknown: {e}") from None
        if any(s.name == name for s in stats.summaries):
            found[device] = stats
    return found


def layout_of(info: pb.ModelInfo) -> Layout:
    key = info.key
    return Layout(dtype=key.dtype, quantization=key.quantization, tp_size=key.tp_size or 1, tp_rank=key.tp_rank,
                  component=key.component or "main")


def targets_for(name: str, runtime_dir: pathlib.Path, devices: list[str] | None = None,
                layouts: list[Layout] | None = None, first: str = "") -> list[Target]:
    """Who builds what: with `devices` and `layouts` (rank r's layout on device r), exactly that;
    otherwise each daemon holding `name` builds the variants of its active version. `first`: how
    the caller publishes a first version (the CLI's flags by default)."""
    if devices:
        return [Target(device, [layout]) for device, layout in zip(devices, layouts)]
    found = []
    for device, stats in holders(name, runtime_dir).items():
        summary = next(s for s in stats.summaries if s.name == name)
        variants = [layout_of(m) for m in stats.models if m.name == name and m.version == summary.active_version]
        if variants:
            found.append(Target(device, variants))
    if not found:
        first = first or f"the first version is loaded with `preload serve DIR --name {name}` (or give --devices)"
        raise NotFoundError(f"no daemon in {runtime_dir} holds {name!r}; {first}")
    return found


def next_version(name: str, runtime_dir: pathlib.Path) -> int:
    """One number above the highest any daemon gave out for `name`, so that every rank agrees."""
    return _next_number(name, holders(name, runtime_dir))


def _next_number(name: str, found: dict[str, pb.Stats]) -> int:
    last = [s.last_version for stats in found.values() for s in stats.summaries if s.name == name]
    return max(last, default=0) + 1


def held_version(name: str, path: str, found: dict[str, pb.Stats]) -> tuple[int, list[str]]:
    """(the version of `name` that daemons hold from the files in `path`, as they are now, and those
    daemons' devices), or (0, []). Such a daemon answers with that version whatever number it is asked
    for: the other ranks must load the files as that number too (serving a model again with another
    --tp-size had its ranks on different numbers, and failed)."""
    try:
        files = stat_identity(path, allow_external=True)  # (the daemons check the links as they load)
    except CheckpointError:
        return 0, []
    held = {(device, m.version) for device, stats in found.items() for m in stats.models if m.name == name
            and not file_differences(tuple(map(file_identity, m.key.files)), files)}
    numbers = {number for _, number in held}
    return (numbers.pop(), sorted(device for device, _ in held)) if len(numbers) == 1 else (0, [])


def publish_dir(name: str, path: str, targets: list[Target], runtime_dir: pathlib.Path, *,
                always_activate: bool = True, keep: int | None = None, max_bytes: int | None = None,
                show_progress: bool = True) -> Published:
    """Loads the checkpoint directory on every target as the next version (or finds the version
    already loaded from those files) and then makes it active everywhere: always, or, without
    `always_activate` (`preload serve`), only if it is new or the model had none."""
    spec = LoadSpec(path=path, name=name)

    def attempt() -> Published:
        found = holders(name, runtime_dir)
        number, held = held_version(name, path, found)
        number = number or _next_number(name, found)

        def load(target: Target, client: DaemonClient, on_progress) -> list[pb.ModelInfo]:
            first, *rest = target.layouts
            return client.load_all(spec.with_layout(first), on_progress, layouts=tuple(rest), version=number,
                                   activate=False, keep=keep, max_bytes=max_bytes)

        try:
            return _publish(name, number, targets, runtime_dir, load, always_activate, show_progress, held)
        except VersionTakenError as e:
            if held:  # the number is the one the files are held as: another number would not help
                raise InvalidRequestError(f"{e} (on {', '.join(held)} these files are v{number}): evict the odd "
                                          f"version (`preload evict {name}@V`) and publish again") from None
            raise

    return _racing(name, attempt)


def publish_tensors(name: str, tensors, config: dict, *, devices: list[str] | None = None,
                    layouts: list[Layout] | None = None, runtime_dir: pathlib.Path | None = None,
                    keep: int | None = None, max_bytes: int | None = None, label: str = "",
                    show_progress: bool = False) -> int:
    """Publishes a live process's tensors ({name: tensor} as in the Hugging Face checkpoint, e.g.
    model.state_dict(), and its config.json as a dict) as the next version of `name` on every daemon
    that holds it (or on `devices`, rank r in layouts[r]), without writing them to disk; moves the
    pointer once every rank is ready. Returns the new version number."""
    runtime_dir = pathlib.Path(runtime_dir) if runtime_dir else default_runtime_dir()
    targets = targets_for(name, runtime_dir, devices, layouts or [Layout()] * len(devices or ()),
                          first=f"publish a first version of it with devices=['cpu:0'] (a device per rank, and their "
                                f"layouts=[...]), and later ones without")
    tensors = dict(tensors)

    def attempt() -> Published:
        number = next_version(name, runtime_dir)

        def send(target: Target, client: DaemonClient, on_progress) -> list[pb.ModelInfo]:
            def progress(sent: int, total: int) -> None:
                on_progress(pb.LoadProgress(stage="sending", bytes_done=sent, bytes_total=total))
            return client.publish(name, tensors, config, version=number, layouts=tuple(target.layouts),
                                  activate=False, keep=keep, max_bytes=max_bytes, label=label, on_progress=progress)

        return _publish(name, number, targets, runtime_dir, send, True, show_progress)

    return _racing(name, attempt).version


def _racing(name: str, attempt: Callable[[], Published]) -> Published:
    """`attempt()`, again with the next number while another publish of `name` took the one it
    picked (every rank must load one number, so the caller picks it, and two callers may pick the
    same); a few times at most."""
    for tries in range(1, PUBLISH_TRIES + 1):
        try:
            return attempt()
        except VersionTakenError as e:
            if tries == PUBLISH_TRIES:
                raise VersionTakenError(f"{e}; other publishes of {name} took the next number {PUBLISH_TRIES} times "
                                        "in a row: publish again once they finish") from None
            log.info("another publish of %s took the number this one picked (%s); picking the next", name, e)
            time.sleep(random.uniform(0, 0.1 * tries))  # two that raced on two daemons in turn fall apart
    raise AssertionError("unreachable")


def _publish(name: str, number: int, targets: list[Target], runtime_dir: pathlib.Path, load: Callable,
             always_activate: bool, show_progress: bool, held: list[str] = ()) -> Published:
    """`held`: the devices that held version `number` before (not made here, never freed here)."""
    results = _on_all(targets, runtime_dir, load, f"{name} v{number}", show_progress)
    failed = [(t, r) for t, r in zip(targets, results) if isinstance(r, Exception)]
    made = [t for t, r in zip(targets, results)
            if not isinstance(r, Exception) and r[0].version == number and t.device not in held]
    if failed:
        for target in made:  # not active, not leased: nothing can be using it yet
            with DaemonClient.for_device(target.device, runtime_dir) as client:
                try:
                    client.evict(name, number)
                except PreloadError as e:
                    log.warning("could not free %s v%d on %s after the failed publish: %s", name, number,
                                target.device, e)
        freed = f"v{number} was freed on {', '.join(t.device for t in made)}; " if made else ""
        raise type(failed[0][1])("; ".join(f"{t.device}: {r}" for t, r in failed) +
                                 f" ({freed}this publish left the active version of {name} as it was)")
    versions = {r[0].version for r in results}
    if len(versions) != 1:
        raise PreloadError(f"the daemons hold these files as different versions of {name} "
                           f"({', '.join(f'{t.device}: v{r[0].version}' for t, r in zip(targets, results))}); "
                           f"evict the odd ones (`preload evict {name}@V`) and publish again")
    found = versions.pop()
    created = found == number and not held
    if always_activate or created:
        for target in targets:
            with DaemonClient.for_device(target.device, runtime_dir) as client:
                client.set_active(name, found)
    return Published(found, created, results)


def _on_all(targets: list[Target], runtime_dir: pathlib.Path, run: Callable, what: str, show_progress: bool) -> list:
    """run(target, client, on_progress) on every target at once, one progress bar each; each result
    or the PreloadError it raised."""
    from tqdm import tqdm  # the progress bars: paid only by commands that load

    results: list = [None] * len(targets)
    bars = [tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{what} {t.device}", position=i,
                 disable=not show_progress, mininterval=0.1 if sys.stderr.isatty() else 2.0)
            for i, t in enumerate(targets)]

    def one(i: int) -> None:
        def on_progress(update) -> None:
            bar = bars[i]
            if update.bytes_total and bar.total != update.bytes_total:
                bar.reset(total=update.bytes_total)
            bar.set_postfix_str(f"{update.stage} {update.tensors_done}/{update.tensors_total} tensors"
                                if update.tensors_total else update.stage, refresh=False)
            bar.update(update.bytes_done - bar.n)
        try:
            with DaemonClient.for_device(targets[i].device, runtime_dir, timeout=60) as client:
                results[i] = run(targets[i], client, on_progress)
        except PreloadError as e:
            results[i] = e

    # Daemon threads: a command interrupted meanwhile exits (the daemons finish their loads on their own).
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # with a timeout: a Ctrl-C the kernel gave another thread is seen here too
            t.join(0.5)
    for bar in bars:
        bar.close()
    return results


def rollback(name: str, version: int, runtime_dir: pathlib.Path) -> list[str]:
    """Moves the active pointer of `name` to `version` on every daemon holding it, after checking
    that each still holds that version. Returns the devices."""
    found = holders(name, runtime_dir)
    if not found:
        raise NotFoundError(f"no daemon in {runtime_dir} holds {name!r}")
    missing = []
    for device, stats in found.items():
        summary = next(s for s in stats.summaries if s.name == name)
        if not any(v.version == version for v in summary.versions):
            have = ", ".join(f"v{v.version}" for v in summary.versions) or "none"
            missing.append(f"{device} (has {have})")
    if missing:
        raise NotFoundError(f"{name} v{version} is not held by {', '.join(missing)}; a freed version comes back "
                            f"with `preload publish {name} --from DIR`")
    for device in found:
        with DaemonClient.for_device(device, runtime_dir) as client:
            client.set_active(name, version)
    return list(found)


def set_pinned(name: str, version: int, pinned: bool, runtime_dir: pathlib.Path) -> list[str]:
    """Pins (or unpins) `version` of `name` on every daemon holding it. Returns the devices."""
    found = holders(name, runtime_dir)
    if not found:
        raise NotFoundError(f"no daemon in {runtime_dir} holds {name!r}")
    for device in found:
        with DaemonClient.for_device(device, runtime_dir) as client:
            client.pin(name, version, pinned)
    return list(found)
