"""`preload bench quant`: what each quantization scheme costs and buys on a real model.

Quality, per scheme, on the default model: slab bytes, cosine of the logits against bf16 over a
fixed public-domain passage (tests/assets/passage.txt), greedy agreement with bf16 on a few prompts,
and perplexity on the passage. Speed: the quantized linear layer against the engine's own bf16 one
(kernels/dense.py: the native GEMV at decode sizes where it is built, else torch's) on this CPU,
at decode (M = 1..16) and prefill (M = 512) sizes, for 2048x2048 and 4096x4096 weights, on the
kernel variant in use (kernels.native; PRELOAD_KERNELS forces one). At decode sizes each scheme
should take at most its bytes / bf16's bytes + 20% (the target row); "!" marks a miss. Each decode
size is timed twice: on one weight, which then stays in the CPU's caches (a 32 MiB matrix fits some
L3s), and from memory ("mem" rows), cycling through enough copies of the weight to exceed 4x the
last-level cache, as a decode step reads its weights.

    preload bench quant [MODEL] [--sizes 2048,4096] [--skip-speed] [--skip-quality] [--json]
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

from preload_cli import argtypes

ROOT = pathlib.Path(__file__).resolve().parents[2]
PASSAGE = ROOT / "tests" / "assets" / "passage.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
GREEDY_TOKENS = 24


def quality(model_path: pathlib.Path) -> list[dict]:
    import torch

    from preload_daemon.plan import LoadSpec, SCHEMES
    from worker.engine import Engine
    from worker.requests import SamplingParams
    from worker.loader import LoadRequest, load_safetensors
    from worker.model import CausalLM
    from worker.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_path)
    passage = torch.tensor([tokenizer.encode(PASSAGE.read_text())])
    rows, reference = [], {}
    for scheme in SCHEMES:
        weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(model_path), quantization=scheme)))
        model = CausalLM.from_config(weights.config, weights.tensors)
        cache = model.new_cache(1, passage.shape[1])
        logits = model.forward(passage, torch.arange(passage.shape[1])[None], cache, torch.tensor([0]),
                               all_logits=True)[0]
        nll = torch.nn.functional.cross_entropy(logits[:-1], passage[0, 1:])
        engine = Engine(model, max_batch=1, max_len=64).start()
        greedy = [engine.generate(tokenizer.encode(p), SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)).tokens
                  for p in PROMPTS]
        engine.stop()
        if scheme == "none":
            reference = {"logits": logits, "greedy": greedy, "ppl": float(nll.exp())}
        cosine = torch.nn.functional.cosine_similarity(logits, reference["logits"], dim=-1).mean()
        agree = sum(a == b for g, r in zip(greedy, reference["greedy"]) for a, b in zip(g, r))
        rows.append({"scheme": scheme, "slab_bytes": sum(_nbytes(t) for t in weights.tensors.values()),
                     "logits_cosine": float(cosine), "greedy_agreement": agree / (GREEDY_TOKENS * len(PROMPTS)),
                     "perplexity": float(nll.exp()), "ppl_vs_bf16": float(nll.exp()) / reference["ppl"] - 1})
        print(f"  {scheme}: done", file=sys.stderr, flush=True)
    return rows


def _nbytes(t) -> int:
    return t.nbytes if hasattr(t, "nbytes") else t.numel() * t.element_size()


DECODE_M = (1, 2, 4, 8, 16)
TARGET_MARGIN = 1.2  # over the bytes ratio: a memory-bound kernel's time follows the bytes it reads
MIN_SECONDS = 0.2    # per timing: small calls repeat until they add up to this
MAX_COPIES = 1024    # of a weight for the rows from memory (small weights: the calls' own cost dominates)
ROUNDS = 10          # turns of side_by_side, at least


def _copies(q, count: int) -> list:
    """`count` copies of a plain or quantized weight, each in memory of its own."""
    from kernels.quant import QuantizedWeight
    if not isinstance(q, QuantizedWeight):
        return [q.clone() for _ in range(count)]
    return [QuantizedWeight(q.scheme, q.weight.clone(), q.scale.clone(),
                            None if q.global_scale is None else q.global_scale.clone(), q.shape) for _ in range(count)]


def side_by_side(calls: dict, repeats: int) -> dict:
    """The median seconds of a call of each function, timed in turns: every round calls each in
    order, a few times (small calls until they add up to about MIN_SECONDS over all rounds), so that
    a machine whose speed drifts between seconds (a VM's memory bandwidth swings 2x here) weighs on
    every ratio alike instead of on whichever function ran then."""
    rounds = max(repeats, ROUNDS)
    per_round = {}
    for name, fn in calls.items():
        start = time.perf_counter()
        fn()
        first = time.perf_counter() - start
        per_round[name] = max(1, min(1000 // rounds, int(MIN_SECONDS / rounds / max(first, 1e-6))))
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            for _ in range(per_round[name]):
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def speed(repeats: int, sizes: tuple[int, ...] = (2048, 4096), memory_bytes: int | None = None) -> dict:
    """The speed rows; the rows from memory cycle each weight's copies through `memory_bytes` (default:
    BANDWIDTH_BYTES or 4x the last-level cache, whichever is more), at most MAX_COPIES of them."""
    import torch

    from kernels.dense import Dense
    from kernels.linear import quantized_linear
    from kernels.quant import SCHEMES, quantize
    from preload_cli.bench.machine import BANDWIDTH_BYTES, last_level_cache_bytes

    rows, targets, copies_of, dense = [], {}, {}, Dense()
    for n in sizes:
        w = torch.randn(n, n)
        base_w = w.bfloat16()
        quantized = {s: quantize(w, s) for s in SCHEMES}
        targets[f"{n}x{n}"] = {s: q.nbytes / (2 * n * n) * TARGET_MARGIN for s, q in quantized.items()}
        for m in DECODE_M + (512,):
            x = torch.randn(m, n).bfloat16()
            calls = {"bf16_ms": lambda: dense(x, base_w)}
            calls.update({s: lambda q=q: quantized_linear(x, q) for s, q in quantized.items()})
            seconds = side_by_side(calls, repeats)
            base = seconds.pop("bf16_ms")
            rows.append({"shape": f"{n}x{n}", "m": m, "bf16_ms": base * 1e3,
                         **{s: t / base for s, t in seconds.items()}})
            print(f"  {n}x{n} M={m}: done", file=sys.stderr, flush=True)
        span = memory_bytes or max(BANDWIDTH_BYTES, 4 * last_level_cache_bytes())
        count = copies_of[f"{n}x{n}"] = min(MAX_COPIES, -(-span // (2 * n * n)))
        copies = {s: _copies(q, count) for s, q in {"bf16_ms": base_w, **quantized}.items()}
        for m in DECODE_M:
            x = torch.randn(m, n).bfloat16()
            calls = {"bf16_ms": lambda: [dense(x, c) for c in copies["bf16_ms"]]}
            calls.update({s: lambda s=s: [quantized_linear(x, c) for c in copies[s]] for s in quantized})
            seconds = side_by_side(calls, repeats)
            base = seconds.pop("bf16_ms")
            rows.append({"shape": f"{n}x{n}", "m": m, "memory": True, "bf16_ms": base / count * 1e3,
                         **{s: t / base for s, t in seconds.items()}})
        del copies
        print(f"  {n}x{n} from memory ({count} copies): done", file=sys.stderr, flush=True)
    return {"rows": rows, "targets": targets, "copies": copies_of}


def run(args) -> int:
    import torch

    from kernels import native
    from preload_daemon.default_model import default_model_path
    model_path = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    result = {"model": str(model_path), "threads": torch.get_num_threads(), "kernels": native.VARIANT}
    if not args.skip_quality:
        result["quality"] = quality(model_path)
    if not args.skip_speed:
        result["speed"] = speed(args.repeats, args.sizes, args.memory_mib << 20 if args.memory_mib else None)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "quality" in result:
        print(f"preload bench quant — quality on {model_path.name} (passage: {PASSAGE.name}, "
              f"{GREEDY_TOKENS} greedy tokens x {len(PROMPTS)} prompts)")
        print(f"{'scheme':<16} {'slab MiB':>9} {'vs bf16':>8} {'logits cos':>11} {'greedy agree':>13} "
              f"{'ppl':>8} {'ppl vs bf16':>12}")
        base = result["quality"][0]["slab_bytes"]
        for r in result["quality"]:
            print(f"{r['scheme']:<16} {r['slab_bytes'] / 2**20:>9.1f} {r['slab_bytes'] / base:>8.2f} "
                  f"{r['logits_cosine']:>11.4f} {r['greedy_agreement']:>12.0%} {r['perplexity']:>8.2f} "
                  f"{r['ppl_vs_bf16']:>+11.1%}")
    if "speed" in result:
        rows, targets = result["speed"]["rows"], result["speed"]["targets"]
        schemes = [k for k in rows[0] if k not in ("shape", "m", "bf16_ms", "memory")]
        print(f"\nquantized linear time / the engine's bf16 linear time on CPU ({result['threads']} threads, kernels: "
              f"{result['kernels']}, medians, all timed in turns over {max(args.repeats, ROUNDS)} rounds); target at "
              f"M <= {DECODE_M[-1]}: the bytes ratio + {TARGET_MARGIN - 1:.0%}, ! = over it")
        print(f"{'weight':<10} {'M':>8} {'bf16 ms':>8} " + " ".join(f"{s:>15}" for s in schemes))
        for shape, target in targets.items():
            print(f"{shape:<10} {'target':>17} " + " ".join(f"{target[s]:>13.2f}x " for s in schemes))
        for r in rows:
            decode = r["m"] in DECODE_M
            marks = ["!" if decode and r[s] > targets[r["shape"]][s] else " " for s in schemes]
            m = f"{r['m']} mem" if r.get("memory") else str(r["m"])
            print(f"{r['shape']:<10} {m:>8} {r['bf16_ms']:>8.3f} " +
                  " ".join(f"{r[s]:>13.2f}x{mark}" for s, mark in zip(schemes, marks)))
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(not 16 <= s <= 16384 or s % 16 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: give square sizes from 16 to 16384, multiples of 16, "
                                         "separated by commas (e.g. 2048,4096)")
    return sizes


def _mib(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of MiB from 1 to 1048576")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--repeats", type=argtypes.repeats, default=5,
                        help="timings per figure, at least (more for fast calls)")
    parser.add_argument("--sizes", type=_sizes, default=(2048, 4096),
                        help="square weights' sizes to time, comma-separated (default 2048,4096)")
    parser.add_argument("--memory-mib", type=_mib, metavar="MIB",
                        help="memory the rows 'from memory' cycle each weight's copies through (default: 512 MiB "
                             "or 4x the last-level cache, whichever is more; less runs faster, but a span within the "
                             "cache times the cache)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--json", action="store_true")

