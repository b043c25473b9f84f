"""`preload bench prefill`: how long a stream pauses while a long prompt arrives, with the prompt
prefilled whole against in parts (`--prefill-chunk`), in one run.

A stream (a 3-token prompt, greedy) decodes; after its 10th token a prompt of --prompt-tokens
arrives and generates 8 tokens. Measured: the stream's longest pause between two tokens from the
long prompt's arrival to its last token, the stream's median step beside it, and the long prompt's
time to its first token. One engine in this process runs both, in turns, its prefill_chunk set
between runs (two engines in one process would each have their own OpenMP thread team, spinning
against the other's: the stream's steps took 5x longer); figures are medians of the repeats.

    preload bench prefill [--model DIR] [--quantization S] [--prompt-tokens 1900] [--chunk 256] [--repeats 3]
                          [--json]
"""

import argparse
import json
import pathlib
import statistics
import threading
import time

from preload_cli import argtypes
from preload_cli.bench import machine

LONG_NEW_TOKENS = 8
TIMEOUT = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR", help="checkpoint (default: the embedded default model)")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--prompt-tokens", type=int, default=1900, help="the long prompt's length (default 1900)")
    parser.add_argument("--chunk", type=int, default=256, help="--prefill-chunk of the engine in parts (default 256)")
    parser.add_argument("--repeats", type=argtypes.repeats, default=3)
    parser.add_argument("--json", action="store_true")


def one_run(engine, long_prompt: list[int]) -> dict:
    """A stream decodes, the long prompt arrives: the stream's longest pause meanwhile, its median
    step, and the long prompt's seconds to its first token."""
    from worker.requests import SamplingParams
    stamps, first, done = [], [], threading.Semaphore(0)
    room = engine.max_len - 3
    stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=room, ignore_eos=True),
                           lambda t: stamps.append(time.perf_counter()), lambda r: done.release())
    deadline = time.monotonic() + TIMEOUT
    while len(stamps) < 10:
        if time.monotonic() > deadline:
            raise RuntimeError("the stream did not start")
        time.sleep(0.002)
    arrived = time.perf_counter()
    long_done = threading.Event()
    engine.submit(long_prompt, SamplingParams(max_tokens=LONG_NEW_TOKENS, ignore_eos=True),
                  lambda t: first.append(time.perf_counter()), lambda r: long_done.set())
    if not long_done.wait(TIMEOUT):
        raise RuntimeError("the long prompt did not finish")
    ended = time.perf_counter()
    stream.cancelled = True
    done.acquire(timeout=TIMEOUT)
    if len(stamps) >= room:
        raise RuntimeError("the stream ended before the long prompt did; lower --prompt-tokens")
    during = [arrived] + [s for s in stamps if arrived < s <= ended] + [ended]
    steps = [b - a for a, b in zip(stamps, stamps[1:]) if b <= arrived]
    return {"longest_pause_s": max(b - a for a, b in zip(during, during[1:])),
            "median_step_s": statistics.median(steps), "first_token_s": first[0] - arrived}


def run(args) -> int:
    from preload_daemon.default_model import default_model_path
    from preload_daemon.plan import LoadSpec
    from worker.engine import Engine
    from worker.loader import LoadRequest, load_safetensors
    from worker.model import CausalLM
    from worker.requests import SamplingParams

    if args.prompt_tokens < 2 or args.chunk < 1 or args.repeats < 1:
        raise SystemExit("--prompt-tokens must be >= 2, --chunk and --repeats >= 1")
    path = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path), quantization=args.quantization)))
    model = CausalLM.from_config(weights.config, weights.tensors)
    max_len = model.spec.context_len(args.prompt_tokens + 1024)
    if args.prompt_tokens + LONG_NEW_TOKENS > max_len - 64:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} leaves too little of the model's {max_len} positions "
                         "for the stream; lower it")
    vocab = model.spec.vocab_size
    long_prompt = [(i * 7919) % (vocab - 10) + 10 for i in range(args.prompt_tokens)]
    modes = {"whole": 0, "parts": args.chunk}
    engine = Engine(model, max_batch=2, max_len=max_len).start()
    runs = {mode: [] for mode in modes}
    try:
        engine.generate(long_prompt[:300], SamplingParams(max_tokens=2, ignore_eos=True))  # lazy set-up
        for _ in range(args.repeats):
            for mode, chunk in modes.items():
                engine.prefill_chunk = chunk  # read by the scheduler when a prompt arrives; it is idle now
                runs[mode].append(one_run(engine, long_prompt))
    finally:
        engine.stop()
    result = {"machine": machine.describe(), "model": str(path), "quantization": args.quantization, "prompt_tokens": args.prompt_tokens,
              "chunk": args.chunk, "runs": runs,
              "median": {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}}
    whole, parts = result["median"]["whole"], result["median"]["parts"]
    result["pause_whole_over_parts"] = whole["longest_pause_s"] / parts["longest_pause_s"]
    result["first_token_parts_over_whole"] = parts["first_token_s"] / whole["first_token_s"]
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"preload bench prefill — {path.name}, {args.quantization}, a {args.prompt_tokens}-token prompt arriving "
          f"while a stream decodes; median of {args.repeats}")
    print(f"machine: {result['machine']}")
    print(f"{'prefill':>18} {'stream: longest pause':>22} {'its median step':>16} {'long prompt: 1st token':>23}")
    for mode, m in result["median"].items():
        label = "whole" if mode == "whole" else f"in parts of {args.chunk}"
        print(f"{label:>18} {m['longest_pause_s'] * 1e3:>19.0f} ms {m['median_step_s'] * 1e3:>13.1f} ms "
              f"{m['first_token_s'] * 1e3:>20.0f} ms")
    print(f"in parts: the stream's longest pause {result['pause_whole_over_parts']:.1f}x shorter; the long prompt's "
          f"first token {result['first_token_parts_over_whole']:.2f}x the time of a whole prefill")
    return 0
