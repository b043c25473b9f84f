"""The daemon-side commands of `preload`: daemon, serve, status, wait-ready, evict, default-model.
(publish, rollback, pin and unpin are in version_commands.)
Each takes the parsed arguments and returns an exit code; what only one command needs is imported
inside it, so `preload --help` and `preload status` start quickly."""

import json
import pathlib
import sys
import time

from preload_cli.argtypes import split_target
from preload_daemon.config import DaemonConfig, parse_device
from preload_daemon.errors import AccessDeniedError, InvalidRequestError, PreloadError


def cmd_daemon(args) -> int:
    from preload_daemon import daemon
    return daemon.run(DaemonConfig(device=args.device, runtime_dir=args.runtime_dir, http_port=args.http_port,
                                   max_sessions=args.max_sessions, allow_external_links=args.allow_external_links,
                                   load_timeout_s=args.load_timeout, threads=args.threads))


def cmd_serve(args) -> int:
    from preload_daemon import supervisor  # tqdm and the loader, paid only by serve
    return supervisor.serve(args.model, name=args.name, tp_size=args.tp_size, devices=args.devices, dtype=args.dtype,
                            quantization=args.quantization, runtime_dir=args.runtime_dir, log_level=args.log_level,
                            supervise=not args.no_supervise, keep=args.keep, max_bytes=args.max_bytes,
                            draft_model=args.draft_model, allow_external_links=args.allow_external_links)


def cmd_default_model(args) -> int:
    from preload_daemon.default_model import default_model_path
    print(default_model_path())
    return 0


def collect_stats(runtime_dir: pathlib.Path, device: str = "", stale: list | None = None) -> list[tuple[str, object]]:
    """(device, Stats or the error that stopped us reading them) per daemon; the sockets dead
    daemons left go to `stale` if given (versions.daemon_sockets)."""
    from preload_daemon.client import DaemonClient  # grpc and torch, paid only when a daemon is asked
    from preload_daemon.versions import daemon_sockets
    rows = []
    for dev, path in daemon_sockets(runtime_dir, stale):
        if device and dev != device:
            continue
        with DaemonClient(path, timeout=3.0) as client:
            try:
                rows.append((dev, client.stats()))
            except PreloadError as e:
                rows.append((dev, e))
    return rows


def cmd_status(args) -> int:
    stale: list = []
    try:
        rows = collect_stats(args.runtime_dir, stale=stale)
    except AccessDeniedError as e:
        print(f"preload status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"runtime_dir": str(args.runtime_dir), "daemons": [
            message_json(s) if not isinstance(s, Exception) else {"device": d, "error": str(s)} for d, s in rows],
            "stale_sockets": [{"device": d, "path": str(p)} for d, p in stale]}, indent=2))
        return 1 if any(isinstance(s, Exception) for _, s in rows) else 0
    gone = ("\nsockets of daemons that are gone (a new daemon for the device replaces its socket):\n"
            + "\n".join(printable(f"  {dev}: {path}") for dev, path in stale)) if stale else ""
    if not rows:
        print(f"no daemons in {args.runtime_dir}; start one with `preload serve MODEL`{gone}")
        return 0
    now = time.time()
    daemons = [["DEVICE", "PID", "UPTIME", "STATE", "MODELS", "RESIDENT", "LEASES", "SESSIONS"]]
    versions = [["MODEL", "VERSION", "DEVICE", "ACTIVE", "PINNED", "STATE", "VARIANTS", "BYTES", "LEASES", "SOURCE"]]
    variants = [["MODEL", "VERSION", "DEVICE", "RANK", "DTYPE", "QUANT", "COMPONENT", "BYTES", "TENSORS", "LEASES"]]
    failures, notes, unreachable = [], [], []
    for dev, s in rows:
        if isinstance(s, Exception):
            daemons.append([dev, "-", "-", "unreachable", "-", "-", "-", "-"])
            unreachable.append(f"  {dev}: {s}")
            continue
        daemons.append([s.device, str(s.pid), human_seconds(now - s.started_at),
                        "serving" if s.serving else "not serving", str(sum(1 for m in s.summaries if m.versions)),
                        human_bytes(s.resident_bytes), str(s.num_leases), str(s.num_sessions)])
        notes += [f"  {s.device}: {line}" for line in s.recovery]
        for m in s.summaries:
            for v in m.versions:
                versions.append([m.name, str(v.version), s.device, "*" if v.active else "", "pin" if v.pinned else "",
                                 v.state, str(v.num_variants), human_bytes(v.bytes), str(v.num_leases), v.source])
            failures += [f"{m.name} {'a new version' if f.startswith('-:') else 'v'}{f.removeprefix('-')} "
                         f"(on {s.device})" for f in m.failures]  # "-": failed before it was given a number
        for m in s.models:
            variants.append([m.name, str(m.version), s.device, f"{m.key.tp_rank}/{m.key.tp_size}", m.key.dtype,
                             m.key.quantization, m.key.component, human_bytes(m.slab_bytes), str(m.num_tensors),
                             str(len(m.leases))])
    print(table(daemons))
    for rows_ in (versions, variants):
        if len(rows_) > 1:
            print()
            print(table(rows_))
    if failures:
        print("\nrecent failed loads:\n" + "\n".join(f"  {printable(f)}" for f in failures))
    if unreachable:
        print("\nunreachable daemons:\n" + "\n".join(printable(line) for line in unreachable))
    if notes:
        print("\nwhat each daemon recovered at start:\n" + "\n".join(printable(line) for line in notes))
    if gone:
        print(gone)
    return 1 if unreachable else 0


def cmd_verify(args) -> int:
    """Re-hashes slabs on their daemons against the digests they were sealed with. Exit 0 if all
    match, 1 if any does not (or no daemon holds the model)."""
    from preload_daemon.client import DaemonClient
    name, version = split_target(args.target) if args.target else ("", 0)
    try:
        device = parse_device(args.device) if args.device else ""
    except PreloadError as e:  # a usage error
        print(f"preload verify: {e}", file=sys.stderr)
        return 2
    rows = [["MODEL", "VERSION", "DEVICE", "LAYOUT", "SLAB", "DIGEST", "OK"]]
    results, silent = [], []
    try:
        rows_ = collect_stats(args.runtime_dir, device)
    except (InvalidRequestError, AccessDeniedError) as e:  # bad set-up
        print(f"preload verify: {e}", file=sys.stderr)
        return 2
    for dev, stats in rows_:
        if isinstance(stats, Exception):
            silent.append(f"daemon {dev} does not answer, so its slabs are not verified: {stats}")
            continue
        if name and not any(m.name == name for m in stats.summaries):
            continue
        with DaemonClient.for_device(dev, args.runtime_dir, timeout=600) as client:
            for check in client.verify(name, version).slabs:
                layout = check.layout
                results.append({"model": check.model, "version": check.version, "device": dev, "slab": check.slab,
                                "expected": check.expected, "actual": check.actual, "ok": check.ok})
                rows.append([check.model, str(check.version), dev, f"{layout.dtype}/{layout.quantization} rank "
                             f"{layout.tp_rank}/{layout.tp_size} {layout.component}", check.slab, check.actual,
                             "ok" if check.ok else check.actual.upper() if check.actual.startswith("gone:")
                             else f"CHANGED (sealed as {check.expected})"])
    bad = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps({"slabs": results, "unreachable": silent, "ok": bool(results) and not bad and not silent},
                         indent=2))
    elif results:
        print(table(rows))
    for line in silent:
        print(f"preload verify: {line}", file=sys.stderr)
    if not results:
        where = f"daemon for {device}" if device else "daemons"
        print(f"preload verify: no slabs{' of ' + name if name else ''} on the {where} in {args.runtime_dir}",
              file=sys.stderr)
        return 1
    gone = [r for r in bad if r["actual"].startswith("gone:")]
    if gone:
        print(f"preload verify: {len(gone)} slab file(s) deleted, replaced or resized in /dev/shm behind the daemon's "
              "back (engines attached keep their mapping, new ones cannot attach); evict and load them again "
              "(`preload evict MODEL@V --force`, then `preload serve`), and find what removes files there (logind's "
              "RemoveIPC, a cleanup job)", file=sys.stderr)
    if len(bad) > len(gone):
        print(f"preload verify: {len(bad) - len(gone)} slab(s) changed after they were sealed, and no longer handed "
              "out (engines attached read the changed bytes); evict and load them again (`preload evict MODEL@V "
              "--force`, then `preload serve`), and find who writes to /dev/shm",
              file=sys.stderr)
    return 1 if bad or silent else 0


# `preload wait-ready` exit codes (argparse uses 2 for bad usage).
READY, TIMED_OUT, FAILED, NO_DAEMON = 0, 1, 3, 4


def cmd_wait_ready(args) -> int:
    """Waits until the daemons (and --model, --version) are ready. Exit codes: 0 ready, 1 timed out
    while loading or waiting for the version, 3 failed (the load or publish failed, or the version
    was freed), 4 no daemon answered by the deadline."""
    if (args.version is not None or args.from_dir) and not args.model:
        print(f"preload wait-ready: {'--version' if args.version is not None else '--from'} needs --model",
              file=sys.stderr)
        return 2
    try:
        device = parse_device(args.device) if args.device else ""
        if args.from_dir:
            from preload_daemon.checkpoint import stat_identity
            stat_identity(args.from_dir, allow_external=True)  # a checkpoint's files, or a one-line error
    except PreloadError as e:  # a usage error (2), not "timed out" (1)
        print(f"preload wait-ready: {e}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            code, reason = readiness(args.runtime_dir, device, args.model, args.version or 0, args.from_dir)
        except (InvalidRequestError, AccessDeniedError) as e:  # bad set-up (a runtime dir we may not use), not a
            print(f"preload wait-ready: {e}", file=sys.stderr)  # timeout
            return 2
        if code == READY:
            print(reason)
            return READY
        if code == FAILED:
            print(f"failed: {reason}", file=sys.stderr)
            return FAILED
        if time.monotonic() >= deadline:
            print(f"not ready after {args.timeout:g}s: {reason}", file=sys.stderr)
            return code
        time.sleep(0.2)


def readiness(runtime_dir: pathlib.Path, device: str, model: str, version: int, path: str = "") -> tuple[int, str]:
    """(READY, what is ready) or (the exit code if it stays like this, why not). `path`: the version
    is the one loaded from that checkpoint's files."""
    rows = collect_stats(runtime_dir, device)
    if not rows:
        return NO_DAEMON, f"no daemon{' for ' + device if device else ''} in {runtime_dir}"
    answering = [(dev, s) for dev, s in rows if not isinstance(s, Exception)]
    if not answering:
        return NO_DAEMON, "; ".join(f"daemon {dev} does not answer ({s})" for dev, s in rows)
    if len(answering) < len(rows):
        dev, error = next((d, s) for d, s in rows if isinstance(s, Exception))
        return TIMED_OUT, f"daemon {dev} does not answer ({error})"
    if not model:
        for dev, stats in answering:
            if not stats.serving:
                return TIMED_OUT, f"daemon {dev} " + ("is still loading" if stats.models else "has no model loaded")
        return READY, "ready"
    holding = [(dev, next((m for m in s.summaries if m.name == model), None)) for dev, s in answering]
    holding = [(dev, m) for dev, m in holding if m is not None]
    if not holding:
        loaded = sorted({m.name for _, s in answering for m in s.summaries if m.versions})
        return TIMED_OUT, f"model {model!r} is not loaded (loaded: {', '.join(loaded) or 'none'})"
    if path:
        from preload_daemon.versions import held_version
        version, _ = held_version(model, path, dict(answering))
        if not version:
            held = ", ".join(sorted({f"v{i.version} from {i.path}" for _, s in answering for i in s.models
                                     if i.name == model}))
            if any(not s.serving for _, s in answering):
                return TIMED_OUT, f"no version of {model} from {path}'s files yet (held: {held or 'none'}); a load runs"
            return FAILED, (f"no daemon holds {model} from {path}'s files as they are now (held: {held or 'none'}); "
                            f"`preload serve {path} --name {model}` loads them")
    for dev, m in holding:
        number = version or m.active_version
        state = next((v.state for v in m.versions if v.version == number), None) if number else None
        failed = next((f for f in m.failures if f.startswith(f"{version}:")), None) if version else \
            (m.failures[0] if m.failures and not number else None)
        if state == "stale" and not version:  # an engine started on the model's files would refuse it
            info = next(i for i in dict(answering)[dev].models if i.name == model and i.version == number)
            return FAILED, (f"{model} v{number} on {dev} is stale ({info.stale_reason}): engines started on its "
                            f"files refuse it; `preload serve {info.path} --name {model}` loads them again "
                            f"(engines given --weights-version {number} still attach)")
        if state == "damaged":
            return FAILED, (f"{model} v{number} on {dev} is damaged (`preload verify` found its slab changed or cut "
                            "short): "
                            f"`preload evict {model}@{number} --force`, then load it again")
        if state in ("ready", "stale"):
            continue
        if state == "loading":
            return TIMED_OUT, f"{model} v{number} on {dev} is still loading"
        if failed:
            return FAILED, f"{model} v{failed} (on {dev})"
        if version and version <= m.last_version:
            return FAILED, f"{model} v{version} on {dev} was freed (evicted or out of retention); publish it again"
        what = f"v{version} is not published yet" if version else "has no active version yet"
        return TIMED_OUT, f"{model} {what} on {dev}"
    numbers = sorted({version or m.active_version for _, m in holding})
    return READY, f"ready: {model} v{', v'.join(map(str, numbers))} on {', '.join(dev for dev, _ in holding)}"


def cmd_evict(args) -> int:
    from preload_daemon.client import DaemonClient  # grpc and torch, paid only when a daemon is asked
    try:
        name, number = split_target(args.target)
    except PreloadError as e:
        print(f"preload evict: {e}", file=sys.stderr)
        return 2
    try:
        device = parse_device(args.device) if args.device else ""
    except PreloadError as e:  # a usage error
        print(f"preload evict: {e}", file=sys.stderr)
        return 2
    try:
        rows = collect_stats(args.runtime_dir, device)
    except (InvalidRequestError, AccessDeniedError) as e:  # bad set-up
        print(f"preload evict: {e}", file=sys.stderr)
        return 2
    silent = [(d, s) for d, s in rows if isinstance(s, Exception)]
    if silent:  # it runs (holds its lock) but does not answer: it may hold a rank of `name`
        print(f"preload evict: daemon {silent[0][0]} does not answer, so whether it holds {name!r} is unknown: "
              f"{silent[0][1]}", file=sys.stderr)
        return 1
    holders = [(d, s) for d, s in rows if any(m.name == name for m in s.summaries)]
    if not holders:
        print(f"preload evict: {name!r} is not loaded on any daemon in {args.runtime_dir}", file=sys.stderr)
        return 1
    for dev, _ in holders:
        with DaemonClient.for_device(dev, args.runtime_dir) as client:
            for m in client.evict(name, number, args.force):
                print(f"evicted {m.name} v{m.version} ({m.key.dtype}/{m.key.quantization} rank "
                      f"{m.key.tp_rank}/{m.key.tp_size}) from {dev} ({human_bytes(m.slab_bytes)})")
    return 0


def message_json(message) -> dict:
    """A protobuf message as JSON data with every field, 64-bit integers as numbers: protobuf's own
    JSON mapping writes them as strings, which jq then compares as text."""
    from google.protobuf import json_format
    from google.protobuf.descriptor import FieldDescriptor as F
    wide = {F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64}

    def numbers(msg, data: dict) -> None:
        for field in msg.DESCRIPTOR.fields:
            value, repeated = getattr(msg, field.name), field.is_repeated
            if field.name not in data:
                continue
            if field.type in wide:
                data[field.name] = [int(v) for v in value] if repeated else int(value)
            elif field.type == F.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
                for m, d in zip(value, data[field.name]) if repeated else [(value, data[field.name])]:
                    numbers(m, d)

    data = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    numbers(message, data)
    return data


def table(rows: list[list[str]]) -> str:
    """Aligned columns; a cell's characters that are not printable (a checkpoint path's escape
    sequences or newlines, which would drive the terminal or break the table) are shown escaped."""
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def printable(text: str) -> str:
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def human_seconds(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
