"""`preload bench spec`: speculative decoding on one checkpoint, in one run.

1. Decode, in this process, greedy, batch 1: tokens/s and tokens per main forward with no
   speculation, with the model itself as its draft (acceptance 1.0: the ceiling of the verification
   mechanics) and with one random MTP layer added to a copy of the checkpoint (acceptance about 0:
   the cost of a draft that never helps). Greedy outputs of both should equal the plain ones; the
   table says from which token on they differ if not (in bf16, the top two logits can tie exactly,
   and the verification forward over K+1 positions, which sums in another order, may break the tie
   the other way: numerics, not the acceptance rule; float32 checkpoints match).
2. Engine process start -> ready with `--speculative mtp` on that copy, main and draft warm from a
   daemon that holds both components (`ipc_cache`) against both cold (`safetensors`).

Runs alternate between variants so that drift hits all alike; figures are medians.

    preload bench spec [--model DIR] [--num-speculative-tokens 2] [--max-tokens 64] [--repeats 3] [--json]
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

from preload_cli import argtypes

PROMPT = "The history of the printing press begins"


def mtp_copy(model: pathlib.Path, into: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A copy of the single-file checkpoint `model` in `into`, with one random MTP layer added."""
    import types

    from safetensors import safe_open

    from preload_cli.models import add_mtp_layers

    file = model / "model.safetensors"
    if not file.exists():
        raise SystemExit(f"{model}: bench spec needs a single-file checkpoint (model.safetensors)")
    config = json.loads((model / "config.json").read_text())
    copy = into / f"{model.name}-mtp"
    copy.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file():
            shutil.copy2(f, copy / f.name)
    if config.get("num_nextn_predict_layers"):
        return copy  # it has MTP layers already (e.g. a test fixture)
    with safe_open(str(file), "pt") as f:
        dtype = f.get_slice("model.embed_tokens.weight")[:1].dtype
    shim = types.SimpleNamespace(  # what add_mtp_layers reads of a transformers model
        config=types.SimpleNamespace(num_hidden_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"]),
        parameters=lambda: iter([types.SimpleNamespace(dtype=dtype)]))
    add_mtp_layers(copy, shim, 1, False, seed)
    return copy


def decode(model: pathlib.Path, k: int, max_tokens: int, repeats: int) -> dict:
    """{variant: {"tokens_per_s": [...], "tokens_per_main_forward", "acceptance_rate", ...}} and
    whether every variant's greedy output equals plain decoding's."""
    import torch

    from preload_daemon.arch import ArchSpec
    from preload_daemon.plan import LoadSpec
    from worker.engine import Engine
    from worker.requests import SamplingParams
    from worker.loader import LoadRequest, load_safetensors
    from worker.model import CausalLM
    from worker.mtp import MTPDraft
    from worker.speculative import Speculator
    from worker.tokenizer import Tokenizer

    main = load_safetensors(LoadRequest(spec=LoadSpec(path=str(model))))
    draft = load_safetensors(LoadRequest(spec=LoadSpec(path=str(model), component="draft")))
    spec = ArchSpec.from_config(main.config)
    tokenizer = Tokenizer.load(model)  # a checkpoint without one (a test fixture) gets fixed token ids
    ids = tokenizer.encode(PROMPT) if tokenizer else [(5 + 37 * i) % spec.vocab_size for i in range(8)]
    lm = CausalLM(spec, main.tensors)
    mtp = MTPDraft(spec, {**main.tensors, **draft.tensors})
    variants = {"no speculation": None, f"self as draft, K={k}": Speculator(lm, k),
                f"random MTP head, K={k}": Speculator(mtp, k)}
    engines = {name: Engine(lm, max_batch=1, max_len=len(ids) + max_tokens + 1, speculator=s).start()
               for name, s in variants.items()}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        outputs = {name: [e.generate(ids, params).tokens] for name, e in engines.items()}  # warm-up
        rates = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                result = engine.generate(ids, params)
                outputs[name].append(result.tokens)
                rates[name].append(len(result.tokens) / result.seconds)
    finally:
        for engine in engines.values():
            engine.stop()
    reference = outputs["no speculation"][0]

    def first_difference(outs: list[list[int]]) -> int | None:
        """The first token index where any run's output leaves plain decoding's, or None."""
        found = [next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), min(len(out), len(reference)))
                 for out in outs if out != reference]
        return min(found) if found else None

    rows = {}
    for name, engine in engines.items():
        s = engine.speculation()
        rows[name] = {"tokens_per_s": rates[name], "tokens_per_s_median": statistics.median(rates[name]),
                      "tokens_per_main_forward": s.get("tokens_per_main_forward", 1.0),
                      "acceptance_rate": s.get("acceptance_rate"),
                      "mean_accepted_length": s.get("mean_accepted_length"),
                      "output_matches": all(out == reference for out in outputs[name]),
                      "first_difference": first_difference(outputs[name])}
    return {"prompt_tokens": len(ids), "max_tokens": max_tokens, "num_speculative_tokens": k,
            "threads": torch.get_num_threads(), "rows": rows,
            "outputs_match": all(r["output_matches"] for r in rows.values())}


def with_daemon(model: pathlib.Path):
    """A private daemon (cpu:0) holding `model`'s main and draft components, for a `with` block."""
    from preload_daemon.plan import Layout
    from preload_daemon.supervisor import DaemonProcess
    from preload_daemon.versions import Target, publish_dir

    class Daemon:
        def __enter__(self):
            self.runtime_dir = pathlib.Path(tempfile.mkdtemp(prefix="plr-", dir="/tmp"))
            self.process = None
            try:
                self.process = DaemonProcess("cpu:0", self.runtime_dir, "WARNING")
                self.process.wait_started()
                target = Target("cpu:0", [Layout(), Layout(component="draft")])
                published = publish_dir(model.name, str(model), [target], self.runtime_dir, show_progress=False)
                self.infos = list(published.variants[0])
            except BaseException:
                self.__exit__()
                raise
            return self

        def __exit__(self, *exc) -> None:
            if self.process is not None:
                self.process.stop()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    return Daemon()


def restart(model: pathlib.Path, k: int, repeats: int) -> dict:
    """{variant: {"start_to_ready_s", "weights_s", samples}} for `--speculative mtp` engines, warm and cold."""
    from preload_cli.bench.restart import Engine

    variants = {"warm (ipc_cache)": "ipc_cache", "cold (safetensors)": "safetensors"}
    samples = {name: [] for name in variants}
    with with_daemon(model) as daemon:
        for _ in range(repeats):
            for name, fmt in variants.items():
                extra = ["--speculative", "mtp", "--num-speculative-tokens", str(k)]
                if fmt == "ipc_cache":
                    extra.append("--no-fallback")
                engine = Engine(model, fmt, daemon.runtime_dir, *extra)
                r = engine.ready
                engine.stop()
                samples[name].append({"start_to_ready": r["ready"] - r["process_start"],
                                      "weights": max(x["weights_done"] - x["weights_start"] for x in r["ranks"]),
                                      "load_format": r["load_format"],
                                      "draft_load_format": r["draft"]["load_format"]})
        slab_bytes = sum(info.slab_bytes for info in daemon.infos)
    out = {name: {"start_to_ready_s": statistics.median(s["start_to_ready"] for s in runs),
                  "weights_s": statistics.median(s["weights"] for s in runs),
                  "load_format": runs[-1]["load_format"], "draft_load_format": runs[-1]["draft_load_format"],
                  "samples": runs} for name, runs in samples.items()}
    warm, cold = out["warm (ipc_cache)"], out["cold (safetensors)"]
    return {"slab_bytes": slab_bytes, "variants": out,
            "ratios": {"start_to_ready_cold_over_warm": cold["start_to_ready_s"] / warm["start_to_ready_s"],
                       "weights_cold_over_warm": cold["weights_s"] / warm["weights_s"]}}


def table(doc: dict) -> str:
    d, r = doc["decode"], doc["restart"]
    lines = [f"decode: {d['prompt_tokens']}-token prompt, {d['max_tokens']} new tokens, greedy, batch 1, "
             f"{d['threads']} threads",
             f"{'variant':<26} {'tokens/s':>9} {'tok/main fwd':>13} {'acceptance':>11} {'output = plain':>15}"]
    for name, row in d["rows"].items():
        acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        same = "yes" if row["output_matches"] else f"no, from #{row['first_difference']}"
        lines.append(f"{name:<26} {row['tokens_per_s_median']:>9.1f} {row['tokens_per_main_forward']:>13.2f} "
                     f"{acc:>11} {same:>15}")
    lines += ["", f"engine start -> ready, --speculative mtp ({r['slab_bytes'] / 2**20:.0f} MiB in the daemon, "
                  "main + draft)",
              f"{'start (main, draft)':<34} {'start -> ready':>15} {'weights phase':>14}"]
    for name, row in r["variants"].items():
        label = f"{name.split(' ')[0]} ({row['load_format']}, {row['draft_load_format']})"
        lines.append(f"{label:<34} {row['start_to_ready_s'] * 1e3:>12.0f} ms {row['weights_s'] * 1e3:>11.1f} ms")
    ratios = r["ratios"]
    lines.append(f"{'cold / warm':<34} {ratios['start_to_ready_cold_over_warm']:>14.2f}x "
                 f"{ratios['weights_cold_over_warm']:>13.1f}x")
    return "\n".join(lines)


def run(args) -> int:
    from preload_cli.bench.machine import describe as machine
    from preload_daemon.default_model import default_model_path

    source = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    work = pathlib.Path(tempfile.mkdtemp(prefix="preload-bench-spec-"))
    try:
        model = mtp_copy(source, work)
        doc = {"model": str(source), "machine": machine(), "repeats": args.repeats,
               "decode": decode(model, args.num_speculative_tokens, args.max_tokens, args.repeats),
               "restart": restart(model, args.num_speculative_tokens, args.repeats)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"preload bench spec — {source.name} + 1 random MTP layer, K={args.num_speculative_tokens}, "
              f"median of {args.repeats}")
        print(f"machine: {doc['machine']}")
        print(table(doc))
    if not doc["decode"]["outputs_match"]:  # reported, not fatal: see the module docstring
        print("note: a speculative greedy output differs from the plain one (in bf16, an exact tie of the top two "
              "logits can break the other way in the multi-position verification forward)", file=sys.stderr)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="single-file checkpoint directory (default: the embedded default model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, help="K, tokens the draft proposes per step")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per decode run")
    parser.add_argument("--repeats", type=argtypes.repeats, default=3)
    parser.add_argument("--json", action="store_true")
