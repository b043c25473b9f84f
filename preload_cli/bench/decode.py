"""`preload bench decode`: decode tokens/s of our engine against transformers' generate, on the
same checkpoint, prompt and dtype, greedy, both in this process; plus our aggregate tokens/s with
several requests batched.

    preload bench decode [MODEL] [--quantization S] [--new-tokens 64] [--repeats 5] [--json]
"""

import argparse
import json
import pathlib
import statistics
import threading
import time

PROMPT = "The history of the printing press begins"


def run(args) -> int:
    import torch
    import transformers

    from preload_daemon.default_model import default_model_path
    from preload_daemon.plan import LoadSpec
    from worker.engine import Engine, SamplingParams
    from worker.loader import LoadRequest, load_safetensors
    from worker.model import CausalLM
    from worker.tokenizer import Tokenizer

    model_path = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    ids = Tokenizer(model_path).encode(PROMPT)
    n = args.new_tokens
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(model_path), quantization=args.quantization)))
    engine = Engine(CausalLM.from_config(weights.config, weights.tensors), max_batch=args.batch,
                    max_len=len(ids) + n + 1).start()
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=weights.tensors[
        "model.embed_tokens.weight"].dtype).eval()  # transformers runs the unquantized checkpoint
    prompt = torch.tensor([ids])

    def ours() -> float:
        return n / engine.generate(ids, params).seconds

    def theirs() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = reference.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.shape[1] == len(ids) + n
        return n / (time.perf_counter() - start)

    def ours_batched() -> float:
        finished = threading.Semaphore(0)
        start = time.perf_counter()
        for _ in range(args.batch):
            engine.submit(ids, params, lambda t: None, lambda r: finished.release())
        for _ in range(args.batch):
            finished.acquire()
        return args.batch * n / (time.perf_counter() - start)

    ours(), theirs()  # warm-up
    rows = {"preload engine, 1 request": [ours() for _ in range(args.repeats)],
            "transformers generate, 1 request": [theirs() for _ in range(args.repeats)],
            f"preload engine, {args.batch} requests": [ours_batched() for _ in range(args.repeats)]}
    engine.stop()
    medians = {k: statistics.median(v) for k, v in rows.items()}
    ratio = medians["preload engine, 1 request"] / medians["transformers generate, 1 request"]
    if args.json:
        print(json.dumps({"model": str(model_path), "quantization": args.quantization, "new_tokens": n,
                          "tokens_per_s": rows, "medians": medians, "ours_over_transformers": ratio,
                          "threads": torch.get_num_threads()}, indent=2))
    else:
        print(f"preload bench decode — {model_path.name} ({args.quantization}), {n} new tokens, greedy, median of "
              f"{args.repeats}, {torch.get_num_threads()} threads")
        for name, value in medians.items():
            print(f"{name:<36} {value:>8.1f} tokens/s")
        print(f"{'ours / transformers (1 request)':<36} {ratio:>8.2f}x")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--quantization", default="none", help="scheme of our engine's projections")
    parser.add_argument("--json", action="store_true")

