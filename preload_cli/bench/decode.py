"""`preload bench decode`: decode tokens/s of our engine against transformers' generate, on the
same checkpoint, prompt and dtype, greedy, both in this process; our aggregate tokens/s with several
requests batched; llama.cpp's where `llama_cpp` is importable; and this machine's memory bandwidth,
measured in the same run, against which the weight bytes a token reads are set. Decode rates count
the tokens after the first over the time from the first to the last (the prefill, whose time to
the first token is shown beside, is not decode); llama.cpp's count its steps after the prompt.

    preload bench decode [MODEL] [--quantization S] [--new-tokens 64] [--prompt-tokens N] [--repeats 5] [--batch 8]
                         [--json]

--prompt-tokens repeats the prompt's tokens to N, so that each decode step attends over N to N + 64
positions: what attention costs at a longer context (the default prompt has 7 tokens).
"""

import argparse
import json
import pathlib
import statistics
import tempfile
import threading
import time

from preload_cli.bench import machine

PROMPT = "The history of the printing press begins"
TARGETS = {"bandwidth_share": 0.6, "ours_over_transformers": 2.0, "batch_over_single": 4.0}
LLAMA_FTYPES = {"none": ("BF16", 32), "int8": ("Q8_0", 7)}  # llama.cpp's file types with the same weight bits


def llama_cpp_tokens_per_s(args, model_path: pathlib.Path, ids: list[int], threads: int) -> tuple[float | None, str]:
    """(llama.cpp's decode tokens/s, on the same prompt and bits, greedy; or None, and why not)."""
    try:
        import llama_cpp
    except ImportError:
        return None, ("skipped: llama_cpp is not importable; `pip install llama-cpp-python` to compare (and pass "
                      "--gguf FILE for a model other than the default)")
    if args.quantization not in LLAMA_FTYPES:
        return None, f"skipped: llama.cpp has no file type with {args.quantization}'s weight bits"
    name, ftype = LLAMA_FTYPES[args.quantization]
    with tempfile.TemporaryDirectory() as tmp:
        if args.gguf:
            gguf = args.gguf
        elif args.model:
            return None, "skipped: pass --gguf FILE (this model as GGUF) to compare against llama.cpp"
        else:  # the default model's own GGUF, re-quantized to the weight bits our engine runs
            from preload_daemon.default_model import gguf_path

            gguf = str(pathlib.Path(tmp) / f"model-{name}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize = ftype, True
            if llama_cpp.llama_model_quantize(str(gguf_path()).encode(), gguf.encode(), params) != 0:
                return None, f"failed: llama.cpp could not write a {name} GGUF"
        llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(ids) + args.new_tokens + 8, n_threads=threads,
                              verbose=False)

        def run() -> float:  # decode steps per second after the prompt's evaluation, as for our rows
            llm.reset()
            llm.eval(ids)
            start = time.perf_counter()
            for _ in range(args.new_tokens):
                llm.eval([llm.sample(temp=0.0)])
            return args.new_tokens / (time.perf_counter() - start)

        run()
        return statistics.median(run() for _ in range(args.repeats)), f"llama.cpp {name}, {threads} threads"


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

    ours(), theirs(), ours_batched()  # warm-up
    single, batched = "preload engine, 1 request", f"preload engine, {args.batch} requests"
    with_logprobs = "preload engine, 1 request, logprobs=5"
    rows = {single: [], with_logprobs: [], "transformers generate, 1 request": [], batched: []}
    first_token = {name: [] for name in rows}
    runs = {single: ours, with_logprobs: lambda: ours(logprobs), "transformers generate, 1 request": theirs,
            batched: ours_batched}
    for _ in range(args.repeats):  # alternated: drift hits every row alike
        for name, measure in runs.items():
            rate, ttft = measure()
            rows[name].append(rate)
            first_token[name].append(ttft)
    engine.stop()
    threads = torch.get_num_threads()
    try:
        llama, llama_note = llama_cpp_tokens_per_s(args, model_path, ids, threads)
    except Exception as e:  # an optional comparison: llama-cpp-python's API moves between releases
        llama, llama_note = None, f"failed: {type(e).__name__}: {e}"
    measured = machine.measure(model_path)
    bandwidth, summed = measured["memory_bandwidth_bytes_per_s"], measured["memory_bytes_summed"]
    medians = {k: statistics.median(v) for k, v in rows.items()}
    ttft = {k: statistics.median(v) for k, v in first_token.items()}
    weight_bytes = model.weight_bytes_per_token()
    ratios = {"bandwidth_share": medians[single] * weight_bytes / bandwidth,
              "ours_over_transformers": medians[single] / medians["transformers generate, 1 request"],
              "batch_over_single": medians[batched] / medians[single],
              "logprobs_on_over_off": medians[with_logprobs] / medians[single]}
    if llama is not None:
        medians[llama_note] = llama
        ratios["ours_over_llama_cpp"] = medians[single] / llama
    if args.json:
        print(json.dumps({"model": str(model_path), "quantization": args.quantization, "new_tokens": n,
                          "prompt_tokens": len(ids),
                          "tokens_per_s": rows, "medians": medians, "first_token_s": ttft, "ratios": ratios,
                          "targets": TARGETS, "weight_bytes_per_token": weight_bytes,
                          "bandwidth_bytes_per_s": bandwidth, "bandwidth_bytes_summed": summed,
                          "llama_cpp": llama_note, "threads": threads, "machine": measured}, indent=2))
        return 0
    print(f"preload bench decode — {model_path.name} ({args.quantization}), {len(ids)} prompt tokens, {n} new "
          f"tokens, greedy, median of {args.repeats}, {threads} threads; decode tokens/s after the first token, "
          f"and the time to it")
    print(machine.line(measured))
    for name, value in medians.items():
        extra = f"   first token {ttft[name] * 1e3:6.0f} ms" if name in ttft else ""
        print(f"{name:<40} {value:>8.1f} tokens/s{extra}")
    if llama is None:
        print(f"{'llama.cpp':<40} {llama_note}")
    print(f"{f'memory bandwidth (sum of {summed >> 20} MiB)':<40} {bandwidth / 1e9:>8.1f} GB/s")
    print(f"{'weight bytes read per token':<40} {weight_bytes / 1e6:>8.1f} MB")
    print(f"{'tokens/s x bytes / bandwidth (1 request)':<40} {ratios['bandwidth_share']:>8.0%}   "
          f"target >= {TARGETS['bandwidth_share']:.0%}")
    print(f"{'ours / transformers (1 request)':<40} {ratios['ours_over_transformers']:>8.2f}x  "
          f"target >= {TARGETS['ours_over_transformers']:.0f}x")
    if llama is not None:
        print(f"{'ours / llama.cpp (1 request)':<40} {ratios['ours_over_llama_cpp']:>8.2f}x  target >= 1x")
    print(f"{f'{args.batch} requests / 1 request (aggregate)':<40} {ratios['batch_over_single']:>8.2f}x  "
          f"target >= {TARGETS['batch_over_single']:.0f}x")
    print(f"{'logprobs on / off (1 request)':<40} {ratios['logprobs_on_over_off']:>8.2f}x")
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; give a whole number, 1 or more") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a token count; give 1 or more")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=_count, default=0,
                        help="repeat the prompt's tokens to this many (decode at a longer context); default: the prompt's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quantization", default="none", help="scheme of our engine's projections")
    parser.add_argument("--gguf", help="the same model as a GGUF file at the same weight bits, for the llama.cpp row "
                                       "(default model: derived from its own GGUF)")
    parser.add_argument("--json", action="store_true")
