"""The `preload` console script: the daemon commands plus the engine commands."""

import argparse
import sys

from preload_daemon import cli as daemon_cli
from preload_daemon.config import parse_device
from preload_daemon.plan import DTYPE_CHOICES, SCHEMES

EPILOG_ENGINE = """examples:
  preload engine --load-format ipc_cache --port 8000          # the default model, warm from the daemon
  preload engine /models/llama --load-format safetensors      # cold, no daemon needed
  preload engine /models/llama --load-format ipc_cache --no-fallback
"""
EPILOG_GENERATE = """examples:
  preload generate --prompt "What is the capital of France?" --chat --max-tokens 32
  preload generate /models/llama --prompt "Once upon a time" --temperature 0.8 --seed 1
"""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--load-format", default="ipc_cache", choices=["ipc_cache", "safetensors"],
                   help="ipc_cache attaches to the daemon (falling back to a cold load); safetensors loads cold")
    p.add_argument("--no-fallback", action="store_true", help="with ipc_cache, fail instead of loading cold")
    p.add_argument("--name", default="", help="model name in the daemon (default: the directory's name)")
    p.add_argument("--device", default="cpu:0", type=parse_device)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--quantization", default="none", choices=SCHEMES,
                   help="scheme of the attention and MLP projections; must match what the daemon loaded")
    p.add_argument("--max-batch", type=int, default=8, help="concurrent sequences (KV cache slots)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens per sequence")


def _engine(args) -> int:
    from worker import main as worker_main  # the engine's imports, paid only by engine commands
    return worker_main.cmd_engine(args)


def _generate(args) -> int:
    from worker import main as worker_main
    return worker_main.cmd_generate(args)


def main(argv=None) -> int:
    parser, sub = daemon_cli.build_parser()
    p = sub.add_parser("engine", help="the engine worker: HTTP /health /ready /metrics /v1/completions",
                       epilog=EPILOG_ENGINE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.set_defaults(func=_engine)

    p = sub.add_parser("generate", help="one-shot generation, JSON on stdout", epilog=EPILOG_GENERATE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_generate)

    for name in ("engine", "generate"):
        daemon_cli.add_common(sub.choices[name])
    return daemon_cli.main(argv, parser)


if __name__ == "__main__":
    sys.exit(main())
