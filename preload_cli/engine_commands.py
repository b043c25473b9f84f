"""The engine commands of `preload`: engine and generate. The engine's imports (model, tokenizer,
HTTP server) load only when one of these runs, so the daemon commands stay quick to start.

Process trees: with --tp-size N, this process is rank 0 and starts ranks 1..N-1 first thing, as the
same command plus the hidden --tp-rank/--rendezvous-port flags (under torchrun, which sets RANK and
WORLD_SIZE, it starts nothing). With --dp-size M, this process is a router that starts M replicas,
each the same command with --dp-size 1 and a Unix socket to listen on; the router itself is a lean
process (worker/router.py) this one execs into."""

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import secrets
import subprocess
import sys

from preload_cli import argtypes
from preload_daemon.arch import DTYPE_CHOICES, SCHEMES
from preload_daemon.config import core_share, parse_device, resolve_devices
from preload_daemon.default_model import default_model_path
from preload_daemon.errors import InvalidRequestError, PreloadError
from preload_daemon.runtime_dir import check_socket_room, ensure_private_dir, remove_dead_routers_dirs

MAX_DP = 64  # replicas of one engine: each is a whole engine process (or N of them)
EPILOG_ENGINE = """examples:
  preload engine --load-format ipc_cache --port 8000          # the default model, warm from the daemon
  preload engine /models/llama --load-format safetensors      # cold, no daemon needed
  preload engine /models/llama --load-format ipc_cache --no-fallback
  preload engine /models/llama --name llama --weights-version 3    # that version, e.g. after a rollback
  preload engine /models/llama --wait-for-daemon 120               # a cold-start hook: the daemon may still load
  preload engine /models/qwen3-mtp --speculative mtp --num-speculative-tokens 2   # its MTP layers draft
  preload engine /models/llama-8b --speculative draft --draft-model /models/llama-1b
  preload engine /models/llama --tp-size 2                    # ranks on cpu:0 and cpu:1 (see `preload serve --tp-size`)
  preload engine /models/llama --dp-size 4                    # 4 replicas behind one port, one copy of the weights
  torchrun --nproc-per-node 2 -m preload_cli engine /models/llama --tp-size 2
"""
EPILOG_GENERATE = """examples:
  preload generate --prompt "What is the capital of France?" --chat --max-tokens 32
  preload generate /models/llama --prompt "Once upon a time" --temperature 0.8 --seed 1
  preload generate /models/llama --prompt "Once upon a time" --tp-size 2 --load-format safetensors
"""


def device_arg(text: str) -> str:
    """parse_device for argparse: a bad device is a usage error (exit 2), not a traceback."""
    try:
        return parse_device(text)
    except PreloadError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags engine and generate share: which model, loaded how, with what limits."""
    p.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--load-format", default="ipc_cache", choices=["ipc_cache", "safetensors"],
                   help="ipc_cache attaches to the daemon (falling back to a cold load); safetensors loads cold")
    p.add_argument("--no-fallback", action="store_true", help="with ipc_cache, fail instead of loading cold")
    p.add_argument("--name", default="", help="model name in the daemon (default: the directory's name)")
    p.add_argument("--weights-version", default="", metavar="V|active",
                   help="attach to this version of --name (a number, or 'active') instead of the version loaded "
                        "from MODEL's files; MODEL still gives the config and tokenizer, and there is no cold "
                        "fallback")
    p.add_argument("--allow-external-links", action="store_true",
                   help="a cold load may read checkpoint files that link out of MODEL's directory (a Hugging Face "
                        "cache snapshot)")
    p.add_argument("--wait-for-daemon", type=argtypes.seconds, default=0.0, metavar="S",
                   help="with ipc_cache, wait up to S seconds for a daemon that is absent or still loading before "
                        "falling back (default 0: fall back at once)")
    p.add_argument("--device", default="cpu:0", type=device_arg, help="the device at TP 1 (default cpu:0)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one process each (default 1)")
    p.add_argument("--devices", default="", help="comma-separated, one per TP rank (default cpu:0..cpu:TP-1); "
                                                 "rank r attaches to the daemon of device r")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--quantization", default="none", choices=SCHEMES,
                   help="scheme of the attention and MLP projections; must match what the daemon loaded")
    p.add_argument("--speculative", default="", choices=["mtp", "draft"],
                   help="speculative decoding: mtp drafts with the checkpoint's MTP layers, draft with --draft-model")
    p.add_argument("--num-speculative-tokens", type=int, default=1, metavar="K",
                   help="tokens the draft proposes per step (default 1)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="the draft checkpoint of --speculative draft (same tokenizer and vocabulary)")
    p.add_argument("--max-batch", type=int, default=8, help="concurrent sequences (KV cache slots)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens per sequence")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="TOKENS",
                   help="a longer prompt arriving while others decode is prefilled this many tokens at a time, "
                        "their decode steps between (default 256; 0: always whole)")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads per process (default: the cores divided among the processes)")
    p.add_argument("--tp-step-timeout", type=argtypes.seconds, default=120.0, metavar="S",
                   help="at --tp-size > 1, a step that has run S seconds while a rank is stopped, or S more "
                        "with no rank of this host at work (a rank hung), ends the engine, naming it (default "
                        "120; 0: never)")
    # Set by the engine itself on the processes it starts.
    p.add_argument("--tp-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=argtypes.port, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="data-parallel replicas behind the port; with ipc_cache they share one copy of the weights")
    p.add_argument("--uds", default="", help=argparse.SUPPRESS)


def engine_config(args):
    """The EngineConfig of this process, from the flags and (under torchrun) RANK/WORLD_SIZE."""
    from worker.config import EngineConfig
    if args.tp_size < 1:
        raise InvalidRequestError(f"--tp-size must be at least 1, got {args.tp_size}")
    rank, torchrun = args.tp_rank, False
    if rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not (os.environ["RANK"].isdigit() and os.environ["WORLD_SIZE"].isdigit()):
            raise InvalidRequestError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                                      "must be whole numbers (as torchrun sets them); unset them outside torchrun")
        rank, torchrun = int(os.environ["RANK"]), True
        if int(os.environ["WORLD_SIZE"]) != args.tp_size:
            raise InvalidRequestError(f"torchrun started {os.environ['WORLD_SIZE']} processes for --tp-size "
                                      f"{args.tp_size}; give torchrun --nproc-per-node {args.tp_size}")
    devices = (args.device,) if args.tp_size == 1 and not args.devices else \
        tuple(resolve_devices(args.devices, args.tp_size))
    threads = args.threads or core_share(args.tp_size * getattr(args, "dp_size", 1))
    config = EngineConfig(
        model=pathlib.Path(os.path.abspath(args.model)) if args.model else default_model_path(), name=args.name,
        load_format=args.load_format, fallback=not args.no_fallback, devices=devices, dtype=args.dtype,
        quantization=args.quantization, runtime_dir=args.runtime_dir, max_batch=args.max_batch,
        max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk, tp_size=args.tp_size, tp_rank=rank or 0,
        rendezvous_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), rendezvous_port=args.rendezvous_port,
        rendezvous_env=torchrun, replica=args.replica, num_threads=threads, weights_version=args.weights_version,
        wait_for_daemon=args.wait_for_daemon, allow_external_links=args.allow_external_links,
        speculative=args.speculative, tp_step_timeout=args.tp_step_timeout,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=pathlib.Path(os.path.abspath(args.draft_model)) if args.draft_model else None)
    return config


def start_followers(args, config):
    """Rank 0 of a TP engine: starts ranks 1..N-1 at once, as this same command told their rank and
    rank 0's rendezvous port, so their imports overlap rank 0's own. Returns the config with that
    port and [(rank, process)]."""
    if config.tp_size == 1 or config.rendezvous_env:
        return config, []
    from worker.procs import free_port, spawn_child
    config.check_fits()  # before any process starts
    port = free_port()
    followers = [(rank, spawn_child([sys.executable, "-m", "preload_cli", *args.argv, "--tp-rank", str(rank),
                                     "--rendezvous-port", str(port)], stdout=subprocess.DEVNULL))
                 for rank in range(1, config.tp_size)]
    return dataclasses.replace(config, rendezvous_port=port), followers


def become_router(args, config) -> None:
    """Replaces this process with the lean DP router (no torch in it), which runs each replica as
    this same command with --dp-size 1."""
    check_socket_room(config.runtime_dir)
    remove_dead_routers_dirs(config.runtime_dir)
    sockets = ensure_private_dir(config.runtime_dir / f"engine-{os.getpid()}-{secrets.token_hex(4)}")
    # Each replica sees --dp-size 1, so it is told its share of the cores here.
    settings = {"replicas": args.dp_size, "socket_dir": str(sockets), "host": args.host, "port": args.port,
                "log_level": args.log_level,
                "command": [sys.executable, "-m", "preload_cli", *args.argv, "--dp-size", "1", "--threads",
                            str(config.num_threads or 1)]}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "worker.router", json.dumps(settings)])


def cmd_engine(args) -> int:
    if not 1 <= args.dp_size <= MAX_DP:
        raise InvalidRequestError(f"--dp-size must be in [1, {MAX_DP}], got {args.dp_size}")
    config = engine_config(args)
    if args.dp_size > 1:
        config.check_fits()
        become_router(args, config)
    if config.tp_rank == 0:
        config, followers = start_followers(args, config)
    gc.disable()  # until start-up is over (worker.main.started)
    from worker import main as worker_main  # the engine's imports, paid only by engine commands
    if config.tp_rank > 0:
        return worker_main.run_follower(config)
    return worker_main.run_engine(config, host=args.host, port=args.port, uds=args.uds, followers=followers)


def cmd_generate(args) -> int:
    config = engine_config(args)
    if config.tp_rank == 0:
        config, followers = start_followers(args, config)
    from worker import main as worker_main
    from worker.requests import SamplingParams
    if config.tp_rank > 0:
        return worker_main.run_follower(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return worker_main.run_generate(config, args.prompt if args.prompt is not None else args.prompt_ids, params,
                                    chat=args.chat, followers=followers)
