"""`preload snapshot check|create|inspect|restore`: CRIU snapshots of TP 1 engines, their weights
re-attached from the daemon (worker/snapshot.py, worker/quiesce.py)."""

import argparse
import json
import os
import pathlib
import signal
import sys
import time
from collections.abc import Mapping

from preload_cli import argtypes

EPILOG = """examples:
  preload snapshot check                                  # can this host snapshot? (CRIU, root, namespaces)
  preload snapshot create --engine http://127.0.0.1:8000 --dir /var/lib/preload/snap1
  preload snapshot inspect /var/lib/preload/snap1
  preload snapshot restore /var/lib/preload/snap1 --port 8001            # in the foreground, like `preload engine`
  preload snapshot restore /var/lib/preload/snap1 --port 0 --detach      # scale out: return once ready
"""


def add_arguments(sub, helps: Mapping[str, str]) -> list[argparse.ArgumentParser]:
    """The snapshot group and its actions' parsers, the group first; `helps`: each command's
    one-line help (preload_cli.main.HELP)."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("snapshot", help=helps["snapshot"],
                       epilog=EPILOG, formatter_class=raw)
    commands = p.add_subparsers(dest="snapshot", required=True, metavar="ACTION")
    check = commands.add_parser("check", help="whether this host can take and restore snapshots, and why not")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)
    create = commands.add_parser("create", help="snapshot a running engine into a new directory",
                                 epilog="The engine drains its requests, lets go of its weights and daemon, is dumped, "
                                        "and serves on (unless --stop).", formatter_class=raw)
    create.add_argument("--engine", required=True, metavar="URL", help="the engine's base URL, e.g. "
                        "http://127.0.0.1:8000")
    create.add_argument("--dir", required=True, type=pathlib.Path, help="new (or empty) snapshot directory")
    create.add_argument("--stop", action="store_true", help="end the original engine after the dump")
    create.add_argument("--drain-timeout", type=argtypes.seconds, default=30.0, metavar="S",
                        help="seconds in-flight requests get to finish first (default 30)")
    create.add_argument("--json", action="store_true", help="print the manifest as JSON")
    create.set_defaults(func=cmd_create)
    inspect = commands.add_parser("inspect", help="print a snapshot's manifest")
    inspect.add_argument("dir", type=pathlib.Path)
    inspect.add_argument("--json", action="store_true", help="the manifest as JSON")
    inspect.set_defaults(func=cmd_inspect)
    restore = commands.add_parser("restore", help="restore an engine from a snapshot; it re-attaches its weights",
                                  epilog="Prints one JSON line once the engine is ready (its port, pid and restore "
                                         "timings), then supervises it until interrupted (or returns with --detach).",
                                  formatter_class=raw)
    restore.add_argument("dir", type=pathlib.Path)
    restore.add_argument("--port", type=argtypes.port, default=None, help="listen here (default: where the original did; "
                         "0 picks a free port)")
    restore.add_argument("--host", default=None, help="listen on this address (default: the original's)")
    restore.add_argument("--detach", action="store_true", help="return once ready, leaving the engine running")
    restore.add_argument("--timeout", type=argtypes.seconds, default=120.0, help="seconds to wait for ready (default 120)")
    restore.add_argument("--log", type=pathlib.Path, default=None, help="with --detach, the engine's log file "
                         "(default: RUNTIME_DIR/snapshots/engine-TIME.log)")
    restore.set_defaults(func=cmd_restore)
    return [p, check, create, inspect, restore]


def cmd_check(args) -> int:
    from worker.criu import check_host
    checks = check_host()
    ok = all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [c.__dict__ for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.name:<{width}}  {'ok' if c.ok else 'NO':<3} {c.detail}")
        print("this host can take and restore snapshots" if ok else "this host cannot snapshot engines (see NO above)")
    return 0 if ok else 1


def _interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP unwind as Ctrl-C does: a create then resumes the engine it quieted and
    removes what it wrote, a restore ends its copy (the default action left an engine parked for
    10 minutes, or a restored copy unwoken)."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)


def cmd_create(args) -> int:
    from worker.snapshot import create
    _interrupt_on_termination()
    manifest = create(args.engine, args.dir, stop=args.stop, drain_timeout=args.drain_timeout,
                      runtime_dir=args.runtime_dir, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print(summary(args.dir, manifest))
    return 0


def cmd_inspect(args) -> int:
    from worker.snapshot import read_manifest
    manifest = read_manifest(args.dir)
    print(json.dumps(manifest, indent=2) if args.json else summary(args.dir, manifest))
    return 0


def summary(directory: pathlib.Path, m: dict) -> str:
    engine, model, host, image = m["engine"], m["engine"]["model"], m["host"], m["image"]
    t = m.get("timings", {})
    rows = [
        ("snapshot", f"{directory} (format {m['format']}, created {m['created']})"),
        ("model", f"{model['name']} v{model['version']}" + (" (followed the active version)"
                                                            if model.get("follows_active") else "")),
        ("weights", f"{model['cache_key'].get('dtype')}, {model['cache_key'].get('quantization')}, "
                    f"{model['weight_bytes'] / 2**20:.1f} MiB in the daemon, digest {model['content_digest']}"),
        ("image", f"{image['bytes'] / 2**20:.1f} MiB ({image['bytes'] / max(image['weight_bytes'], 1):.0%} of the "
                  "weight bytes)"),
        ("engine", f"pid {engine['pid']} on {engine['device']}, listened on {engine['listen'].get('host')}:"
                   f"{engine['listen'].get('port')}, kernels {engine['kernels']}; original {m.get('original')}"),
        ("host", f"kernel {host['kernel']}, {host['machine']}, criu {host['criu']}, python {host['python']}, "
                 f"torch {host['torch']}, preload {host['preload']}"),
        ("canary", f"{len(m['canary']['prompt_ids'])} prompt tokens -> {m['canary']['tokens']}"),
    ]
    if "dump_start" in t:
        rows.append(("timings", f"quiet in {t['quiet'] - t['quiesce_start']:.2f}s, dump {t['dumped'] - t['dump_start']:.2f}s"
                     + (f", original serving again {t['original_ready'] - t['dumped']:.2f}s later"
                        if t.get("original_ready") else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_restore(args) -> int:
    from worker import control
    from worker.criu import SnapshotError
    from worker.snapshot import restore
    _interrupt_on_termination()
    if args.detach:  # the engine outlives this command: it must not hold our stdout open
        default = control.control_dir(args.runtime_dir) / f"engine-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        log_path = args.log or default
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise SnapshotError(f"cannot open the log {log_path}: {e.strerror}; give --log a file in a directory "
                                "that exists") from None
        streams = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), fd, fd]
    else:
        streams = [0, 1, 2]
    restored = restore(args.dir, port=args.port, host=args.host, runtime_dir=args.runtime_dir, timeout=args.timeout,
                       streams=streams, tied=not args.detach)
    ready = restored.ready
    if args.detach:  # else the engine printed it on our stdout, which it shares
        print(json.dumps({**ready, "log": str(log_path)}), flush=True)
    r = ready.get("restored", {})
    print(f"preload snapshot restore: engine pid {restored.pid} ready on port {ready.get('port')} "
          f"{r.get('ready', 0) - r.get('restore_start', 0):.3f}s after the restore started", file=sys.stderr)
    if args.detach:
        return 0
    try:  # SIGTERM, or SIGHUP (the terminal gone), ends the engine; a SIGKILL too (tied)
        while restored.process.poll() is None:
            time.sleep(0.2)
        return restored.process.returncode
    except KeyboardInterrupt:
        return restored.stop()
