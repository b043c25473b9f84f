"""The engine commands of `preload`: engine and generate. The engine's imports (model, tokenizer,
HTTP server) load only when one of these runs, so the daemon commands stay quick to start."""

import argparse

from preload_daemon.config import parse_device
from preload_daemon.errors import PreloadError
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
    p.add_argument("--device", default="cpu:0", type=device_arg)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--quantization", default="none", choices=SCHEMES,
                   help="scheme of the attention and MLP projections; must match what the daemon loaded")
    p.add_argument("--max-batch", type=int, default=8, help="concurrent sequences (KV cache slots)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens per sequence")


def cmd_engine(args) -> int:
    from worker import main as worker_main  # the engine's imports, paid only by engine commands
    return worker_main.cmd_engine(args)


def cmd_generate(args) -> int:
    from worker import main as worker_main
    return worker_main.cmd_generate(args)
