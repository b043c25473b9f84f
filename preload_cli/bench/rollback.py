"""`preload bench rollback`: getting an engine ready on an older version by rolling the daemon's
pointer back, against a cold restart from that version's files; and the throughput of a publish
from a live process against one from a checkpoint directory.

A private daemon holds MODEL as v1 and a perturbed copy of it (same config and tokenizer, the
weights plus small seeded noise, written to a temporary directory) as v2, the active one. Each
repeat alternates:

  rollback  `preload rollback NAME --to 1` (versions.rollback), then `preload engine MODEL --name
            NAME --weights-version active --load-format ipc_cache --no-fallback`; timed from the
            rollback call to the engine's ready timestamp. The pointer then goes back to v2, so
            that every rollback moves it.
  cold      `preload engine MODEL --load-format safetensors` (v1's files); timed from the spawn
            to the ready timestamp.

Both also report the engine's own start -> ready and its weights phase (from the ready line's
process_start, weights_start, weights_done, ready).

Publish throughput, alternated the same way, on a separate model name with retention keep=0 (each
publish frees the version before it, so every directory publish really loads):

  live      the weights of `AutoModelForCausalLM.from_pretrained(MODEL)` in this process, streamed
            with versions.publish_tensors (no disk);
  dir       versions.publish_dir of MODEL (read from the page cache after the first repeat).

GB/s counts the slab bytes of the version made.

    preload bench rollback [--model DIR] [--repeats 5] [--json]
"""

import argparse
import json
import pathlib
import shutil
import statistics
import tempfile
import time

from preload_cli import argtypes
from preload_cli.bench.machine import describe as machine
from preload_cli.bench.restart import Engine, with_daemon
from preload_daemon.errors import CheckpointError, PreloadError

DEVICE = "cpu:0"
NOISE = 1e-2  # of each weight's standard deviation: another version, the same model for all practical purposes


def perturbed_copy(model: pathlib.Path, target: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A copy of the checkpoint `model` in `target`: the same config, tokenizer and index files, and
    every floating-point tensor plus small seeded noise (so its files and content are another version's)."""
    import torch  # paid only when the benchmark runs: parsing the CLI stays torch-free
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(model.glob("*.safetensors"))
    if not (model / "config.json").is_file() or not shards:
        raise CheckpointError(f"{model} is not a safetensors checkpoint directory (config.json and *.safetensors); "
                              "pass one with --model DIR")
    target.mkdir(parents=True)
    for path in model.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, target / path.name)
    generator = torch.Generator().manual_seed(seed)
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=generator) * (NOISE * tensor.float().std())
                tensors[name] = (tensor.float() + noise).to(tensor.dtype)
        save_file(tensors, str(target / shard.name), metadata=metadata)
    return target


def engine_sample(engine: Engine, since: float) -> dict:
    r = engine.ready
    return {"to_ready": r["ready"] - since, "start_to_ready": r["ready"] - r["process_start"],
            "weights": r["weights_done"] - r["weights_start"], "load_format": r["load_format"],
            "weights_version": r.get("weights_version", 0)}


def measure_rollback(model: pathlib.Path, name: str, runtime_dir: pathlib.Path, old: int, new: int,
                     repeats: int) -> dict:
    """{"rollback": [...], "cold": [...]}, alternated: engine ready on `old` by a rollback, or cold."""
    from preload_daemon.versions import rollback

    samples = {"rollback": [], "cold": []}
    for _ in range(repeats):
        since = time.time()
        rollback(name, old, runtime_dir)
        called = time.time()
        engine = Engine(model, "ipc_cache", runtime_dir, "--name", name, "--weights-version", "active",
                        "--no-fallback")
        try:
            sample = engine_sample(engine, since)
        finally:
            engine.stop()
        if sample["weights_version"] != old:
            raise RuntimeError(f"after the rollback to v{old} the engine attached v{sample['weights_version']}")
        samples["rollback"].append({**sample, "rollback_call": called - since})
        rollback(name, new, runtime_dir)  # back to the newer version: the next rollback moves the pointer again

        since = time.time()
        engine = Engine(model, "safetensors", runtime_dir)
        try:
            samples["cold"].append(engine_sample(engine, since))
        finally:
            engine.stop()
    return samples


def slab_bytes(name: str, version: int, runtime_dir: pathlib.Path) -> int:
    from preload_daemon.client import DaemonClient
    with DaemonClient.for_device(DEVICE, runtime_dir) as client:
        return sum(m.slab_bytes for m in client.list_models() if m.name == name and m.version == version)


def measure_publish(model: pathlib.Path, runtime_dir: pathlib.Path, repeats: int) -> dict:
    """{"live": [...], "dir": [...]}: seconds and slab bytes of each publish, alternated."""
    import transformers
    from preload_daemon.plan import Layout
    from preload_daemon.versions import Target, publish_dir, publish_tensors

    transformers.utils.logging.disable_progress_bar()
    live = transformers.AutoModelForCausalLM.from_pretrained(model, dtype="auto")
    tensors, config = live.state_dict(), live.config.to_dict()
    name = f"{model.name}-publish"
    samples = {"live": [], "dir": []}
    for _ in range(repeats):
        start = time.perf_counter()
        version = publish_tensors(name, tensors, config, devices=[DEVICE], layouts=[Layout()],
                                  runtime_dir=runtime_dir, keep=0)
        seconds = time.perf_counter() - start
        samples["live"].append({"seconds": seconds, "bytes": slab_bytes(name, version, runtime_dir)})

        start = time.perf_counter()
        published = publish_dir(name, str(model), [Target(DEVICE, [Layout()])], runtime_dir, keep=0,
                                show_progress=False)
        seconds = time.perf_counter() - start
        if not published.created:
            raise RuntimeError(f"{model} was still loaded as {name} v{published.version}: that publish loaded nothing")
        samples["dir"].append({"seconds": seconds, "bytes": sum(v.slab_bytes for v in published.variants[0])})
    return samples


def summarise(rollback: dict, publish: dict) -> tuple[dict, dict]:
    def median(rows, key):
        return statistics.median(r[key] for r in rows)

    summary = {kind: {"to_ready_s": median(rows, "to_ready"), "start_to_ready_s": median(rows, "start_to_ready"),
                      "weights_s": median(rows, "weights"), "n": len(rows)} for kind, rows in rollback.items()}
    summary["rollback"]["rollback_call_s"] = median(rollback["rollback"], "rollback_call")
    for kind, rows in publish.items():
        summary[f"publish_{kind}"] = {"seconds": median(rows, "seconds"), "bytes": rows[0]["bytes"],
                                      "GBps": statistics.median(r["bytes"] / r["seconds"] / 1e9 for r in rows),
                                      "n": len(rows)}
    warm, cold = summary["rollback"], summary["cold"]
    ratios = {"to_ready_cold_over_rollback": cold["to_ready_s"] / warm["to_ready_s"],
              "start_to_ready_cold_over_rollback": cold["start_to_ready_s"] / warm["start_to_ready_s"],
              "weights_cold_over_rollback": cold["weights_s"] / warm["weights_s"],
              "publish_GBps_live_over_dir": summary["publish_live"]["GBps"] / summary["publish_dir"]["GBps"]}
    return summary, ratios


def table(summary: dict, ratios: dict) -> str:
    rows = (("rollback (ipc_cache, v1 by pointer)", summary["rollback"]),
            ("cold restart (safetensors, v1 files)", summary["cold"]))
    lines = [f"{'engine ready on the older version':<38} {'to ready':>10} {'start -> ready':>15} {'weights phase':>14}"]
    for label, row in rows:
        lines.append(f"{label:<38} {row['to_ready_s'] * 1e3:>7.0f} ms {row['start_to_ready_s'] * 1e3:>12.0f} ms "
                     f"{row['weights_s'] * 1e3:>11.1f} ms")
    lines.append(f"{'cold / rollback':<38} {ratios['to_ready_cold_over_rollback']:>9.2f}x "
                 f"{ratios['start_to_ready_cold_over_rollback']:>14.2f}x "
                 f"{ratios['weights_cold_over_rollback']:>13.1f}x")
    lines.append(f"(the rollback call itself: {summary['rollback']['rollback_call_s'] * 1e3:.1f} ms)")
    lines.append("")
    lines.append(f"{'publish a version':<38} {'time':>10} {'GB/s':>15}")
    for label, key in (("from a live transformers model", "publish_live"),
                       ("from a checkpoint directory", "publish_dir")):
        row = summary[key]
        lines.append(f"{label:<38} {row['seconds'] * 1e3:>7.0f} ms {row['GBps']:>15.3f}")
    lines.append(f"{'live / dir (GB/s)':<38} {'':>10} {ratios['publish_GBps_live_over_dir']:>14.2f}x")
    return "\n".join(lines)


def run(args) -> int:
    from preload_daemon.default_model import default_model_path

    model = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    name = model.name
    work = pathlib.Path(tempfile.mkdtemp(prefix="preload-bench-rollback-"))
    try:
        newer = perturbed_copy(model, work / f"{model.name}-v2")
        with with_daemon(model, name=name) as daemon:
            from preload_daemon.versions import publish_dir, targets_for
            runtime_dir = daemon.runtime_dir
            old = daemon.info.version
            new = publish_dir(name, str(newer), targets_for(name, runtime_dir), runtime_dir,
                              show_progress=False).version
            rollback = measure_rollback(model, name, runtime_dir, old, new, args.repeats)
            publish = measure_publish(model, runtime_dir, args.repeats)
            slab = daemon.info.slab_bytes
    except RuntimeError as e:  # an engine that did not become ready, or attached the wrong version
        raise PreloadError(str(e)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary, ratios = summarise(rollback, publish)
    if args.json:
        print(json.dumps({"machine": machine(), "model": str(model), "slab_bytes": slab, "repeats": args.repeats,
                          "versions": {"old": old, "new": new}, "summary": summary, "ratios": ratios,
                          "samples": {**rollback, **{f"publish_{k}": v for k, v in publish.items()}}}, indent=2))
    else:
        print(f"preload bench rollback — {model.name} ({slab / 2**20:.1f} MiB slab), {machine()}, "
              f"median of {args.repeats}")
        print(table(summary, ratios))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--repeats", type=argtypes.repeats, default=5, help="alternated runs of each kind (default 5)")
    parser.add_argument("--json", action="store_true")
