"""The daemon-side commands of `preload`: daemon, serve, status, wait-ready, evict, bench.
worker/cli.py adds the engine commands on top of this parser."""

import argparse
import json
import logging
import pathlib
import sys
import time

from google.protobuf import json_format

from preload_daemon import supervisor
from preload_daemon.client import DaemonClient
from preload_daemon.config import DaemonConfig, default_runtime_dir, parse_device
from preload_daemon.errors import PreloadError
from preload_daemon.plan import DTYPE_CHOICES, SCHEMES

EPILOG_SERVE = """examples:
  preload serve /models/Qwen3-8B                       # one daemon on cpu:0 (or reuse it)
  preload serve /models/llama --tp-size 2 --devices cpu:0,cpu:1
  preload serve /models/llama --dtype float32 --name llama-fp32
"""


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", type=pathlib.Path, default=None,
                        help="private directory of sockets and logs (default: $PRELOAD_RUNTIME_DIR, "
                             "$XDG_RUNTIME_DIR/preload or /tmp/preload-$UID)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser(prog: str = "preload") -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog=prog, description="Weight-cache daemons and engine workers that attach "
                                     "to them zero-copy.", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("daemon", help="run one bare per-device daemon in the foreground",
                       epilog="examples:\n  preload daemon --device cpu:0\n  preload daemon --device cpu:1 "
                              "--http-port 8101", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu:0", type=parse_device, help="cpu:N or cuda:N (default cpu:0)")
    p.add_argument("--http-port", type=int, default=None, help="also serve HTTP /health and /ready on this port")
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("serve", help="start (or reuse) daemons, load a model on every rank, supervise",
                       epilog=EPILOG_SERVE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--name", default="", help="model name in the daemon (default: the directory's name)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--devices", default="", help="comma-separated, one per rank (default cpu:0..cpu:TP-1)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--quantization", default="none", choices=SCHEMES,
                   help="scheme of the attention and MLP projections (DESIGN.md section 5)")
    p.add_argument("--no-supervise", action="store_true", help="exit once loaded, leaving the daemons running")
    p.set_defaults(func=supervisor.cmd_serve)

    p = sub.add_parser("status", help="daemons, models, versions, leases",
                       epilog="examples:\n  preload status\n  preload status --json | jq .daemons[0].models",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("wait-ready", help="exit 0 once daemons are serving (and MODEL loaded)",
                       epilog="examples:\n  preload wait-ready --timeout 600\n  preload wait-ready --model llama",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="also require this model to be ready")
    p.add_argument("--device", default="", help="only this daemon (default: every daemon found)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    p.set_defaults(func=cmd_wait_ready)

    p = sub.add_parser("evict", help="free a model (all versions, or MODEL@VERSION)",
                       epilog="examples:\n  preload evict llama\n  preload evict llama@3 --force",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="MODEL[@VERSION]")
    p.add_argument("--device", default="", help="only on this daemon (default: every daemon holding it)")
    p.add_argument("--force", action="store_true", help="evict even if leased (mapped workers keep their pages)")
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("default-model", help="print the embedded default model's path (converting it once)",
                       epilog="examples:\n  preload default-model\n  preload serve \"$(preload default-model)\"",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=cmd_default_model)

    p = sub.add_parser("demo", help="the whole story on the default model: daemon, cold and warm engines, an answer")
    _script_command(p, "demo")

    p = sub.add_parser("bench", help="benchmarks (DESIGN.md section 8)")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _script_command(bench.add_parser("attach", help="attach time vs cold-read time, 0.1 / 1 / 4 GB"), "bench_attach")
    _script_command(bench.add_parser("restart", help="engine start -> ready, cold vs warm"), "bench_restart")
    _script_command(bench.add_parser("decode", help="decode tokens/s: our engine vs transformers"), "bench_decode")
    _script_command(bench.add_parser("quant", help="quantization schemes: bytes, quality, linear speed"), "bench_quant")

    for p in sub.choices.values():
        add_common(p)
    for b in bench.choices.values():
        add_common(b)
    return parser, sub


def main(argv=None, parser=None) -> int:
    parser = parser or build_parser()[0]
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")
    args.runtime_dir = args.runtime_dir or default_runtime_dir()
    try:
        return args.func(args) or 0
    except PreloadError as e:
        print(f"preload {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def cmd_daemon(args) -> int:
    from preload_daemon import daemon
    return daemon.run(DaemonConfig(device=args.device, runtime_dir=args.runtime_dir, http_port=args.http_port))


def cmd_default_model(args) -> int:
    from preload_daemon.default_model import default_model_path
    print(default_model_path())
    return 0


def daemon_sockets(runtime_dir: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """(device, socket) for every daemon socket in the runtime dir."""
    found = []
    for path in sorted(runtime_dir.glob("daemon-*.sock")):
        kind, _, index = path.stem.removeprefix("daemon-").partition("-")
        found.append((f"{kind}:{index}", path))
    return found


def collect_stats(runtime_dir: pathlib.Path, device: str = "") -> list[tuple[str, object]]:
    """(device, Stats or the error that stopped us reading them) per daemon."""
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


def _script_command(parser: argparse.ArgumentParser, name: str) -> None:
    """Benchmarks and the demo live in scripts/ of the source tree (runnable on their own too);
    each defines add_arguments(parser) and run(args)."""
    import importlib.util
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    if not path.exists():
        parser.set_defaults(func=lambda args: sys.exit(f"preload: {path} not found; benchmarks and the demo run "
                                                       "from a source checkout (pip install -e .)"))
        return
    if str(path.parent.parent) not in sys.path:
        sys.path.insert(0, str(path.parent.parent))  # the scripts import each other as scripts.*
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser.description = module.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


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


if __name__ == "__main__":
    sys.exit(main())
