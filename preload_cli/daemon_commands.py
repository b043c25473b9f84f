"""The daemon-side commands of `preload`: daemon, serve, status, wait-ready, evict, default-model.
Each takes the parsed arguments and returns an exit code; what only one command needs is imported
inside it, so `preload --help` and `preload status` start quickly."""

import json
import pathlib
import sys
import time

from preload_daemon.config import DaemonConfig, parse_device
from preload_daemon.errors import PreloadError


def cmd_daemon(args) -> int:
    from preload_daemon import daemon
    return daemon.run(DaemonConfig(device=args.device, runtime_dir=args.runtime_dir, http_port=args.http_port))


def cmd_serve(args) -> int:
    from preload_daemon import supervisor  # tqdm and the loader, paid only by serve
    return supervisor.serve(args.model, name=args.name, tp_size=args.tp_size, devices=args.devices, dtype=args.dtype,
                            quantization=args.quantization, runtime_dir=args.runtime_dir, log_level=args.log_level,
                            supervise=not args.no_supervise)


def cmd_default_model(args) -> int:
    from preload_daemon.default_model import default_model_path
    print(default_model_path())
    return 0


def collect_stats(runtime_dir: pathlib.Path, device: str = "") -> list[tuple[str, object]]:
    """(device, Stats or the error that stopped us reading them) per daemon."""
    from preload_daemon.client import DaemonClient  # grpc and torch, paid only when a daemon is asked
    from preload_daemon.versions import daemon_sockets
    rows = []
    for dev, path in daemon_sockets(runtime_dir):
        if device and dev != device:
            continue
        with DaemonClient(path, timeout=3.0) as client:
            try:
                rows.append((dev, client.stats()))
            except PreloadError as e:
                rows.append((dev, e))
    return rows


def cmd_status(args) -> int:
    rows = collect_stats(args.runtime_dir)
    if args.json:
        from google.protobuf import json_format
        print(json.dumps({"runtime_dir": str(args.runtime_dir), "daemons": [
            json_format.MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            if not isinstance(s, Exception) else {"device": d, "error": str(s)} for d, s in rows]}, indent=2))
        return 0
    if not rows:
        print(f"no daemons in {args.runtime_dir}; start one with `preload serve MODEL`")
        return 0
    now = time.time()
    daemons = [["DEVICE", "PID", "UPTIME", "STATE", "MODELS", "RESIDENT", "LEASES"]]
    models = [["MODEL", "VERSION", "ACTIVE", "DEVICE", "RANK", "DTYPE", "QUANT", "BYTES", "TENSORS", "LEASES",
               "STATE"]]
    for dev, s in rows:
        if isinstance(s, Exception):
            daemons.append([dev, "-", "-", "unreachable", "-", "-", "-"])
            continue
        daemons.append([s.device, str(s.pid), human_seconds(now - s.started_at),
                        "serving" if s.serving else "not serving", str(len(s.models)),
                        human_bytes(s.resident_bytes), str(s.num_leases)])
        for m in s.models:
            models.append([m.name, str(m.version), "*" if m.active else "", s.device,
                           f"{m.key.tp_rank}/{m.key.tp_size}", m.key.dtype, m.key.quantization,
                           human_bytes(m.slab_bytes), str(m.num_tensors), str(len(m.leases)), m.state])
    print(table(daemons))
    if len(models) > 1:
        print()
        print(table(models))
    return 0


def cmd_wait_ready(args) -> int:
    device = parse_device(args.device) if args.device else ""
    deadline = time.monotonic() + args.timeout
    while True:
        reason = not_ready_reason(args.runtime_dir, device, args.model)
        if reason is None:
            print("ready")
            return 0
        if time.monotonic() >= deadline:
            print(f"not ready after {args.timeout:g}s: {reason}", file=sys.stderr)
            return 1
        time.sleep(0.2)


def not_ready_reason(runtime_dir: pathlib.Path, device: str, model: str) -> str | None:
    """Why the daemons are not ready yet, or None if they are."""
    rows = collect_stats(runtime_dir, device)
    if not rows:
        return f"no daemon{' for ' + device if device else ''} in {runtime_dir}"
    for dev, stats in rows:
        if isinstance(stats, Exception):
            return f"daemon {dev} does not answer ({stats})"
        if not stats.serving and not stats.models:
            return f"daemon {dev} has no model loaded"
        if model:
            states = [m.state for m in stats.models if m.name == model and m.active]
            if not states:
                return f"model {model!r} is not loaded on {dev} (loaded: " \
                       f"{', '.join(sorted({m.name for m in stats.models})) or 'none'})"
            if states[0] != "ready":
                return f"model {model!r} on {dev} is {states[0]}"
        elif not stats.serving:
            return f"daemon {dev} is still loading"
    return None


def cmd_evict(args) -> int:
    from preload_daemon.client import DaemonClient  # grpc and torch, paid only when a daemon is asked
    name, _, version = args.target.partition("@")
    if version and not version.isdigit():
        print(f"preload evict: bad version {version!r} in {args.target!r}; use MODEL@N, e.g. llama@2", file=sys.stderr)
        return 2
    device = parse_device(args.device) if args.device else ""
    holders = [(d, s) for d, s in collect_stats(args.runtime_dir, device)
               if not isinstance(s, Exception) and any(m.name == name for m in s.models)]
    if not holders:
        print(f"preload evict: {name!r} is not loaded on any daemon in {args.runtime_dir}", file=sys.stderr)
        return 1
    for dev, _ in holders:
        with DaemonClient.for_device(dev, args.runtime_dir) as client:
            for m in client.evict(name, int(version or 0), args.force):
                print(f"evicted {m.name} v{m.version} from {dev} ({human_bytes(m.slab_bytes)})")
    return 0


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
