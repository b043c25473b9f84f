"""`preload bench decode`: decode tokens/s of our engine against transformers' generate, on the
same checkpoint, prompt and dtype, greedy, both in this process; our aggregate tokens/s with several
requests batched; llama.cpp's where `llama_cpp` is importable (in a process of its own:
preload_cli/bench/llama_cpp.py); and this machine's memory bandwidth, against which the weight
bytes a token reads are set. Every row runs once a repeat, in turns, and the bandwidth is measured
right before each one-request run: the share of it is each run's own, then their median (a VM's
memory swings up to 2x between minutes, so a figure measured once, before or after, compared runs
with another minute's). Decode rates count the tokens after the first over the time from the first
to the last (the prefill, whose time to the first token is shown beside, is not decode); llama.cpp's
count its steps after the prompt.

    preload bench decode [MODEL] [--quantization S] [--new-tokens 64] [--prompt-tokens N] [--repeats 5] [--batch 8]
                         [--json]

--prompt-tokens repeats the prompt's tokens to N, so that each decode step attends over N to N + 64
positions: what attention costs at a longer context (the default prompt has 7 tokens).
"""

import argparse
import json
import pathlib
import statistics
import threading
import time

from preload_cli import argtypes
from preload_cli.bench import machine
from preload_cli.bench.llama_cpp import LlamaCpp

PROMPT = "The history of the printing press begins"
TARGETS = {"bandwidth_share": 0.6, "ours_over_transformers": 2.0, "batch_over_single": 4.0}


def run(args) -> int:
    import torch
    import transformers

    from preload_daemon.default_model import default_model_path
    from preload_daemon.plan import LoadSpec
    from worker.engine import Engine
    from worker.requests import SamplingParams
    from worker.loader import LoadRequest, load_safetensors
    from worker.model import CausalLM
    from worker.tokenizer import Tokenizer

    model_path = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    ids = Tokenizer(model_path).encode(PROMPT)
    if args.prompt_tokens:
        ids = (ids * -(-args.prompt_tokens // len(ids)))[:args.prompt_tokens]
    n = args.new_tokens
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(model_path), quantization=args.quantization)))
    model = CausalLM.from_config(weights.config, weights.tensors)
    engine = Engine(model, max_batch=args.batch, max_len=len(ids) + n + 1).start()
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=model.dtype).eval()
    prompt = torch.tensor([ids])  # transformers runs the unquantized checkpoint

    def ours(with_params=params) -> tuple[float, float]:
        """(decode tokens/s: the tokens after the first over the time from the first to the last;
        seconds to the first token, the prefill)."""
        stamps, done = [], threading.Event()
        start = time.perf_counter()
        engine.submit(ids, with_params, lambda t: stamps.append(time.perf_counter()), lambda r: done.set())
        done.wait()
        assert len(stamps) == n
        return (n - 1) / (stamps[-1] - stamps[0]), stamps[0] - start

    logprobs = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5)

    class Stamps(transformers.generation.streamers.BaseStreamer):
        """When generate hands out the prompt, then each new token."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def theirs() -> tuple[float, float]:
        stamps = Stamps()
        start = time.perf_counter()
        with torch.no_grad():
            out = reference.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=stamps)
        assert out.shape[1] == len(ids) + n and len(stamps.times) == n + 1
        return (n - 1) / (stamps.times[-1] - stamps.times[1]), stamps.times[1] - start

    def ours_batched() -> tuple[float, float]:
        """Aggregate decode tokens/s once every request has its first token, and the time to that."""
        stamps = [[] for _ in range(args.batch)]
        finished = threading.Semaphore(0)
        start = time.perf_counter()
        for i in range(args.batch):
            engine.submit(ids, params, lambda t, i=i: stamps[i].append(time.perf_counter()),
                          lambda r: finished.release())
        for _ in range(args.batch):
            finished.acquire()
        first, last = max(s[0] for s in stamps), max(s[-1] for s in stamps)
        return args.batch * (n - 1) / (last - first), first - start

    single, batched = "preload engine, 1 request", f"preload engine, {args.batch} requests"
    with_logprobs = "preload engine, 1 request, logprobs=5"
    runs = {single: ours, with_logprobs: lambda: ours(logprobs), "transformers generate, 1 request": theirs,
            batched: ours_batched}
    threads = torch.get_num_threads()
    probe = machine.MemoryProbe()
    llama = LlamaCpp(ids, args.quantization, n, threads, args.gguf, args.model)  # in turns, in a process of its own
    try:
        rows = {name: [] for name in runs}
        first_token = {name: [] for name in runs}
        llama_rates = []  # a row once all its runs came back (a failure says why instead)
        bandwidths = []  # measured right before each 1-request run: the VM's memory swings between minutes
        for measure in runs.values():  # warm-up
            measure()
        llama.run()
        for _ in range(args.repeats):  # alternated: drift hits every row alike
            for name, measure in runs.items():
                if name == single:
                    bandwidths.append(probe.measure())
                rate, ttft = measure()
                rows[name].append(rate)
                first_token[name].append(ttft)
            llama_rates.append(llama.run())
        if llama.available:
            rows[llama.name] = llama_rates
    finally:
        llama.close()
    engine.stop()
    measured = machine.measure(model_path, probe)
    del probe
    medians = {k: statistics.median(v) for k, v in rows.items()}
    ttft = {k: statistics.median(v) for k, v in first_token.items()}
    weight_bytes = model.weight_bytes_per_token()
    shares = [rate * weight_bytes / bandwidth for rate, bandwidth in zip(rows[single], bandwidths)]
    ratios = {"bandwidth_share": statistics.median(shares),
              "ours_over_transformers": medians[single] / medians["transformers generate, 1 request"],
              "batch_over_single": medians[batched] / medians[single],
              "logprobs_on_over_off": medians[with_logprobs] / medians[single]}
    if llama.available:
        ratios["ours_over_llama_cpp"] = medians[single] / medians[llama.name]
    if args.json:
        print(json.dumps({"model": str(model_path), "quantization": args.quantization, "new_tokens": n,
                          "prompt_tokens": len(ids),
                          "tokens_per_s": rows, "medians": medians, "first_token_s": ttft, "ratios": ratios,
                          "targets": TARGETS, "weight_bytes_per_token": weight_bytes,
                          "bandwidth_bytes_per_s": bandwidths, "bandwidth_shares": shares,
                          "llama_cpp": llama.name, "threads": threads, "machine": measured}, indent=2))
        return 0
    print(f"preload bench decode — {model_path.name} ({args.quantization}), {len(ids)} prompt tokens, {n} new "
          f"tokens, greedy, median of {args.repeats}, {threads} threads; decode tokens/s after the first token, "
          f"and the time to it")
    print(machine.line(measured))
    for name, value in medians.items():
        extra = f"   first token {ttft[name] * 1e3:6.0f} ms" if name in ttft else ""
        print(f"{name:<40} {value:>8.1f} tokens/s{extra}")
    if not llama.available:
        print(f"{'llama.cpp':<40} {llama.name}")
    low, high = min(bandwidths) / 1e9, max(bandwidths) / 1e9
    print(f"{'memory bandwidth before each 1 request':<40} {statistics.median(bandwidths) / 1e9:>8.1f} GB/s "
          f"(median; {low:.1f}-{high:.1f}, sum of {measured['memory_bytes_summed'] >> 20} MiB)")
    print(f"{'weight bytes read per token':<40} {weight_bytes / 1e6:>8.1f} MB")
    print(f"{'tokens/s x bytes / bandwidth (1 request)':<40} {ratios['bandwidth_share']:>8.0%}   "
          f"(median of each run's; {min(shares):.0%}-{max(shares):.0%})  "
          f"target >= {TARGETS['bandwidth_share']:.0%}")
    print(f"{'ours / transformers (1 request)':<40} {ratios['ours_over_transformers']:>8.2f}x  "
          f"target >= {TARGETS['ours_over_transformers']:.0f}x")
    if llama.available:
        print(f"{'ours / llama.cpp (1 request)':<40} {ratios['ours_over_llama_cpp']:>8.2f}x  target >= 1x")
    print(f"{f'{args.batch} requests / 1 request (aggregate)':<40} {ratios['batch_over_single']:>8.2f}x  "
          f"target >= {TARGETS['batch_over_single']:.0f}x")
    print(f"{'logprobs on / off (1 request)':<40} {ratios['logprobs_on_over_off']:>8.2f}x")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--new-tokens", type=argtypes.bounded(2, 1 << 17, "new tokens"), default=64)
    parser.add_argument("--prompt-tokens", type=argtypes.bounded(1, 1 << 17, "a token count"), default=0,
                        help="repeat the prompt's tokens to this many (decode at a longer context); default: the prompt's")
    parser.add_argument("--repeats", type=argtypes.repeats, default=5)
    parser.add_argument("--batch", type=argtypes.bounded(1, 256, "requests"), default=8)
    parser.add_argument("--quantization", default="none", help="scheme of our engine's projections")
    parser.add_argument("--gguf", help="the same model as a GGUF file at the same weight bits, for the llama.cpp row "
                                       "(default model: derived from its own GGUF)")
    parser.add_argument("--json", action="store_true")
