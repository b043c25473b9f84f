"""The `preload` console script: one parser with every command, and main(). The commands live in
daemon_commands (daemon, serve, status, wait-ready, evict, verify, default-model), engine_commands
(engine, generate), version_commands (publish, rollback, pin, unpin), snapshot_commands (snapshot
check, create, inspect, restore), demo and bench/ (attach, restart, decode, prefill, quant,
replicas, rollback, spec).

Only the command being run has its parser built and its modules imported (the others are listed
with their one-line help): `preload snapshot restore`, on every restore's path to ready, starts
without the daemon's, the engine's or the benchmarks' imports."""

import argparse
import os
import pathlib
import signal
import sys
from types import ModuleType

from preload_cli import argtypes
from preload_daemon.config import LOG_LEVELS, configure_logging, default_runtime_dir
from preload_daemon.errors import PreloadError

RAW = argparse.RawDescriptionHelpFormatter
EPILOG_SERVE = """examples:
  preload serve /models/Qwen3-8B                       # one daemon on cpu:0 (or reuse it)
  preload serve /models/llama --tp-size 2 --devices cpu:0,cpu:1
  preload serve /models/llama --dtype float32 --name llama-fp32
"""

EPILOG_WAIT_READY = """exit codes:
  0  ready
  1  timed out: a daemon is still loading, or the model or version is not there yet
  2  bad usage
  3  failed: the model's load or the version's publish failed, or the version was freed
  4  no daemon answered before the timeout

examples:
  preload wait-ready --timeout 600
  preload wait-ready --model llama --timeout 600 && preload engine /models/llama
  preload wait-ready --model llama --version 7
  preload wait-ready --model llama --from /models/llama
"""


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, e.g. 1,2,3") from None


def add_common(parser: argparse.ArgumentParser, runtime_dir: bool = True) -> None:
    """--log-level, and --runtime-dir unless the command makes a private one of its own (demo, bench)."""
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    if not runtime_dir:
        return
    parser.add_argument("--runtime-dir", type=pathlib.Path, default=None,
                        help="private directory of sockets and logs (default: $PRELOAD_RUNTIME_DIR, "
                             "$XDG_RUNTIME_DIR/preload or /tmp/preload-$UID)")


def add_module_command(parser: argparse.ArgumentParser, module: ModuleType) -> None:
    """A benchmark or the demo: its docstring is the description, add_arguments(parser) and run(args)."""
    parser.description = module.__doc__
    parser.formatter_class = RAW
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def add_external_links(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-external-links", action="store_true",
                   help="load checkpoint files that are symlinks out of the model directory (a Hugging Face cache "
                        "snapshot links into ../../blobs); refused by default")


def _daemon(sub) -> list:
    from preload_cli import daemon_commands as dc
    from preload_cli.engine_commands import device_arg
    p = sub.add_parser("daemon", help=HELP["daemon"],
                       epilog="examples:\n  preload daemon --device cpu:0\n  preload daemon --device cpu:1 "
                              "--http-port 8101", formatter_class=RAW)
    p.add_argument("--device", default="cpu:0", type=device_arg, help="cpu:N or cuda:N (default cpu:0)")
    p.add_argument("--http-port", type=argtypes.port, default=None,
                   help="also serve HTTP /health, /ready and /metrics on this port")
    p.add_argument("--max-sessions", type=int, default=1024,
                   help="attached processes beyond which new sessions are refused (default 1024)")
    p.add_argument("--load-timeout", type=argtypes.seconds, default=3600.0, metavar="S",
                   help="a load or publish still running after S seconds fails and frees what it made (default 3600)")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads for conversions and quantization (default 0: every core; preload serve "
                        "gives each of its daemons its share)")
    add_external_links(p)
    p.set_defaults(func=dc.cmd_daemon)
    return [p]


def _serve(sub) -> list:
    from preload_cli import daemon_commands as dc
    from preload_cli import version_commands
    from preload_daemon.arch import DTYPE_CHOICES, SCHEMES
    p = sub.add_parser("serve", help=HELP["serve"], epilog=EPILOG_SERVE, formatter_class=RAW)
    p.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--name", default="", help="model name in the daemon (default: the directory's name)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--devices", default="", help="comma-separated, one per rank (default cpu:0..cpu:TP-1)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--quantization", default="none", choices=SCHEMES,
                   help="scheme of the attention and MLP projections (embeddings, norms and lm_head keep --dtype)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="also load this draft checkpoint (for engines with --speculative draft); a checkpoint with "
                        "MTP layers gets its draft component without this")
    p.add_argument("--no-supervise", action="store_true", help="exit once loaded, leaving the daemons running")
    add_external_links(p)
    version_commands.add_retention(p)
    p.set_defaults(func=dc.cmd_serve)
    return [p]


def _status(sub) -> list:
    from preload_cli import daemon_commands as dc
    p = sub.add_parser("status", help=HELP["status"],
                       epilog="exit codes: 0, or 1 when a daemon does not answer (its row says why)\n\n"
                              "examples:\n  preload status\n  preload status --json | jq .daemons[0].models",
                       formatter_class=RAW)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=dc.cmd_status)
    return [p]


def _wait_ready(sub) -> list:
    from preload_cli import daemon_commands as dc
    p = sub.add_parser("wait-ready", help=HELP["wait-ready"], epilog=EPILOG_WAIT_READY, formatter_class=RAW)
    p.add_argument("--model", default="", help="also require this model's active version to be ready")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--version", type=argtypes.bounded(1, argtypes.MAX_VERSION, "a version"), default=None,
                       help="require this version of --model instead")
    which.add_argument("--from", dest="from_dir", default="", metavar="DIR",
                       help="require the version of --model loaded from DIR's checkpoint files as they are now (the "
                            "one an engine started on DIR attaches) instead; 3 at once if no daemon is loading and "
                            "none holds it")
    p.add_argument("--device", default="", help="only this daemon (default: every daemon found)")
    p.add_argument("--timeout", type=argtypes.seconds, default=300.0, help="seconds (default 300)")
    p.set_defaults(func=dc.cmd_wait_ready)
    return [p]


def _versions(sub) -> list:
    from preload_cli import version_commands
    version_commands.add_arguments(sub, HELP)
    return [sub.choices[name] for name in ("publish", "rollback", "pin", "unpin")]


def _evict(sub) -> list:
    from preload_cli import daemon_commands as dc
    p = sub.add_parser("evict", help=HELP["evict"],
                       epilog="examples:\n  preload evict llama\n  preload evict llama@3 --force",
                       formatter_class=RAW)
    p.add_argument("target", metavar="MODEL[@VERSION]")
    p.add_argument("--device", default="", help="only on this daemon (default: every daemon holding it)")
    p.add_argument("--force", action="store_true", help="evict even if leased (mapped workers keep their pages)")
    p.set_defaults(func=dc.cmd_evict)
    return [p]


def _verify(sub) -> list:
    from preload_cli import daemon_commands as dc
    p = sub.add_parser("verify", help=HELP["verify"],
                       epilog="examples:\n  preload verify\n  preload verify llama@3 --json", formatter_class=RAW)
    p.add_argument("target", nargs="?", default="", metavar="MODEL[@VERSION]", help="default: every slab")
    p.add_argument("--device", default="", help="only on this daemon (default: every daemon)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=dc.cmd_verify)
    return [p]


def _default_model(sub) -> list:
    from preload_cli import daemon_commands as dc
    p = sub.add_parser("default-model", help=HELP["default-model"],
                       epilog="examples:\n  preload default-model\n  preload serve \"$(preload default-model)\"",
                       formatter_class=RAW)
    p.set_defaults(func=dc.cmd_default_model)
    return [p]


def _demo(sub) -> list:
    from preload_cli import demo
    p = sub.add_parser("demo", help=HELP["demo"])
    add_module_command(p, demo)
    return [p]


def _bench(sub) -> list:
    from preload_cli.bench import attach, decode, prefill, quant, replicas, restart, rollback, spec
    p = sub.add_parser("bench", help=HELP["bench"])
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    add_module_command(bench.add_parser("attach", help="attach time vs cold-read time, 0.1 / 1 / 4 GB"), attach)
    add_module_command(bench.add_parser("restart", help="engine start -> ready, cold vs warm"), restart)
    add_module_command(bench.add_parser("decode", help="decode tokens/s: our engine vs transformers"), decode)
    add_module_command(bench.add_parser("prefill", help="a stream's longest pause while a long prompt arrives: "
                                        "prefilled whole vs in parts"), prefill)
    add_module_command(bench.add_parser("quant", help="quantization schemes: bytes, quality, linear speed"), quant)
    add_module_command(bench.add_parser("replicas", help="memory of M DP replicas: warm (one slab) vs cold"),
                       replicas)
    add_module_command(bench.add_parser("rollback", help="rollback -> engine ready on the older version vs a cold "
                                        "restart; publish throughput"), rollback)
    add_module_command(bench.add_parser("spec", help="speculative decoding: tokens/s and tokens per main forward, "
                                        "draft warm vs cold"), spec)
    return [p, *bench.choices.values()]


def _snapshot(sub) -> list:
    from preload_cli import snapshot_commands
    return snapshot_commands.add_arguments(sub, HELP)[1:]  # the group's actions take the common flags, not the group


def _engine(sub) -> list:
    from preload_cli import engine_commands
    p = sub.add_parser("engine", help=HELP["engine"], epilog=engine_commands.EPILOG_ENGINE, formatter_class=RAW)
    engine_commands.add_model_args(p)
    engine_commands.add_engine_args(p)
    p.set_defaults(func=engine_commands.cmd_engine)
    return [p]


def _generate(sub) -> list:
    from preload_cli import engine_commands
    p = sub.add_parser("generate", help=HELP["generate"], epilog=engine_commands.EPILOG_GENERATE, formatter_class=RAW)
    engine_commands.add_model_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-ids", type=token_ids, metavar="ID,ID,...",
                        help="the prompt as token ids (for checkpoints without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=engine_commands.cmd_generate)
    return [p]


HELP = {
    "daemon": "run one bare per-device daemon in the foreground",
    "serve": "start (or reuse) daemons, load a model on every rank, supervise",
    "status": "daemons, models, versions, leases",
    "wait-ready": "exit 0 once daemons are serving (and MODEL, VERSION ready)",
    "publish": "load a checkpoint as the next version of a model, then make it active",
    "rollback": "make an older version the active one on every rank",
    "pin": "pin a version: a pinned one is never freed by retention",
    "unpin": "unpin a version: retention may free it again",
    "evict": "free a model (all versions, or MODEL@VERSION)",
    "verify": "re-hash slabs against the digests they were sealed with",
    "default-model": "print the embedded default model's path (converting it once)",
    "demo": "the whole story on the default model: daemon, cold and warm engines, an answer",
    "bench": "benchmarks: attach time, engine restarts, decode speed, prefill in parts, quantization, replicas, "
             "rollback, speculative decoding",
    "snapshot": "CRIU snapshots of TP 1 engines, weights re-attached from the daemon",
    "engine": "the engine worker: HTTP /health /ready /metrics /v1/models /v1/completions /v1/chat/completions",
    "generate": "one-shot generation, JSON on stdout",
}
"""Each command's one-line help, as `preload --help` lists it (the parsers built use the same)."""

COMMANDS = [(("daemon",), _daemon), (("serve",), _serve), (("status",), _status), (("wait-ready",), _wait_ready),
            (("publish", "rollback", "pin", "unpin"), _versions), (("evict",), _evict), (("verify",), _verify),
            (("default-model",), _default_model), (("demo",), _demo), (("bench",), _bench),
            (("snapshot",), _snapshot), (("engine",), _engine), (("generate",), _generate)]
"""The top-level commands in `preload --help`'s order, and what builds each one's parser."""


def build_parser(prog: str = "preload", argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command (argv None), or of the one `argv` runs, the others listed only."""
    parser = argparse.ArgumentParser(prog=prog, description="Weight-cache daemons and engine workers that attach "
                                     "to them zero-copy.", formatter_class=RAW)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else (argv[0] if argv and not argv[0].startswith("-") else "")
    for names, build in COMMANDS:
        if chosen is None or chosen in names:
            for p in build(sub):
                add_common(p, runtime_dir=names[0] not in ("demo", "bench"))
        else:
            for name in names:
                sub.add_parser(name, help=HELP[name])
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser(argv=argv).parse_args(argv)
    args.argv = argv  # engines start their other ranks and replicas as the same command
    configure_logging(args.log_level)
    if hasattr(args, "runtime_dir"):
        given = args.runtime_dir
        args.runtime_dir = pathlib.Path(os.path.abspath(given)) if given else default_runtime_dir()
    if args.command in ("demo", "bench"):  # SIGTERM (timeout, a supervisor) unwinds: engines and temp dirs go
        signal.signal(signal.SIGTERM, _terminated)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # here, where a reader gone is caught, not at the interpreter's exit
        return code
    except PreloadError as e:
        print(f"preload {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `preload status | head`: the reader is gone, and so is what is left to print
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (or the exit's flush raises again)
        return 141  # as a process that SIGPIPE ended


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
