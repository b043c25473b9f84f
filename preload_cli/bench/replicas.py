"""`preload bench replicas`: the memory of M data-parallel replicas, warm against cold. A daemon
holds the model and `preload engine --dp-size M --load-format ipc_cache` runs M replicas that map
its slab; then `--dp-size M --load-format safetensors` runs M replicas that each load their own
copy. PSS (shared pages split among their users) and USS (pages no other process has) per process
and in total, read by psutil once every replica has served a request.

    preload bench replicas [M] [--model DIR] [--json]
"""

import argparse
import json
import pathlib
import statistics

from preload_cli.bench.machine import describe as machine
from preload_cli.bench.restart import Engine, with_daemon

MiB = 2**20


def memory(pid: int, role: str) -> dict:
    import psutil
    info = psutil.Process(pid).memory_full_info()
    return {"role": role, "pid": pid, "pss": info.pss, "uss": info.uss, "rss": info.rss}


def run_replicas(model: pathlib.Path, runtime_dir: pathlib.Path, load_format: str, replicas: int,
                 daemons: tuple[int, ...] = ()) -> list[dict]:
    """Starts M replicas behind one router, has each answer, and measures every process (and the
    `daemons`, while the replicas still map their slab)."""
    import urllib.request  # here, not at the top: every `preload engine` imports this module

    extra = ["--dp-size", str(replicas), "--max-batch", "1", "--max-model-len", "512"]
    engine = Engine(model, load_format, runtime_dir, *extra, *(["--no-fallback"] if load_format == "ipc_cache" else []))
    try:
        body = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}).encode()
        for _ in range(2 * replicas):
            request = urllib.request.Request(engine.url + "/v1/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=120).read()
        rows = [memory(pid, "daemon") for pid in daemons] + [memory(engine.proc.pid, "router")]
        rows += [memory(r["engine"]["pid"], f"replica {r['replica']} ({r['engine']['load_format']})")
                 for r in engine.ready["replicas"]]
        import psutil
        rows += [memory(child.pid, f"renderer of replica {r['replica']}") for r in engine.ready["replicas"]
                 for child in psutil.Process(r["engine"]["pid"]).children()]  # its chat template's process
        return rows
    finally:
        engine.stop()


def run(args) -> int:
    from preload_daemon.default_model import default_model_path
    model = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    with with_daemon(model) as daemon:
        pids = tuple(p.proc.pid for p in daemon.processes)
        warm = run_replicas(model, daemon.runtime_dir, "ipc_cache", args.replicas, pids)
        cold = run_replicas(model, daemon.runtime_dir, "safetensors", args.replicas)
        slab = daemon.info.slab_bytes
    totals = {name: {k: sum(r[k] for r in rows) for k in ("pss", "uss")} for name, rows in
              (("warm", warm), ("cold", cold))}
    def replica_uss(rows):
        return statistics.median(r["uss"] for r in rows if r["role"].startswith("replica"))

    result = {"machine": machine(), "model": str(model), "replicas": args.replicas, "slab_bytes": slab,
              "warm": warm, "cold": cold, "totals": totals,
              "replica_uss_median": {"warm": replica_uss(warm), "cold": replica_uss(cold)},
              "ratio_cold_over_warm_pss": totals["cold"]["pss"] / totals["warm"]["pss"]}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"preload bench replicas — {model.name}, slab {slab / MiB:.1f} MiB, {args.replicas} replicas, "
          f"{result['machine']}")
    print(f"{'setup':<6} {'process':<26} {'PSS MiB':>9} {'USS MiB':>9}")
    for name, rows in (("warm", warm), ("cold", cold)):
        for r in rows:
            print(f"{name:<6} {r['role']:<26} {r['pss'] / MiB:>9.1f} {r['uss'] / MiB:>9.1f}")
        print(f"{name:<6} {'total':<26} {totals[name]['pss'] / MiB:>9.1f} {totals[name]['uss'] / MiB:>9.1f}")
    uss = result["replica_uss_median"]
    print(f"per replica, median USS: warm {uss['warm'] / MiB:.1f} MiB, cold {uss['cold'] / MiB:.1f} MiB: a cold "
          f"replica holds {(uss['cold'] - uss['warm']) / MiB:.1f} MiB more, against a {slab / MiB:.1f} MiB slab")
    print(f"cold / warm total PSS: {result['ratio_cold_over_warm_pss']:.2f}x "
          f"(target: warm replicas hold one copy of the weights between them, in the daemon's slab)")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("replicas", nargs="?", type=int, default=2, help="replicas M (default 2)")
    parser.add_argument("--model", default="", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--json", action="store_true")
