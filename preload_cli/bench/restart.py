"""`preload bench restart`: engine process start -> /ready, cold (`safetensors`) against warm
(`ipc_cache`, attached to a daemon that holds the model) against a snapshot restore (`preload
snapshot restore`, from its spawn to the restored engine's ready; TP 1 where CRIU works), and the
weights phase alone (for a restore: its re-attach). Also the snapshot's image size against the
weight bytes. Targets: restore <= 0.5 s and >= 4x faster than warm; image < 25% of the weights.

Runs alternate cold and warm so that drift hits both alike. It also times, alternated the same
way, a new interpreter importing what an engine imports against one importing torch alone (the
floor of any torch engine); target: at most 1.1x. Cold runs read the checkpoint from the
page cache (a restart on the same host); `--drop-cache` adds cold runs that read it from disk.

With `--tp-size N`, N daemons (cpu:0..cpu:N-1, or cuda:0..cuda:N-1 with `--device-kind cuda`) hold
one rank's shard each and every engine runs N rank processes; start -> ready is rank 0's, the
weights phase the slowest rank's.

    preload bench restart [MODEL | --synthetic-gb G] [--repeats 5] [--drop-cache] [--tp-size N]
                          [--device-kind cpu|cuda] [--no-snapshot] [--json]
"""

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from preload_cli import argtypes
from preload_cli.bench import machine
from preload_cli.bench.attach import drop_page_cache

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Engine:
    """One `preload engine` process; `ready` is its readiness line."""

    def __init__(self, model: pathlib.Path, load_format: str, runtime_dir: pathlib.Path, *extra: str):
        self.spawned = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preload_cli", "engine", str(model), "--load-format", load_format, "--port", "0",
             "--runtime-dir", str(runtime_dir), "--log-level", "WARNING", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            line = self.proc.stdout.readline()
        except BaseException:  # Ctrl-C or SIGTERM while it starts: it must not outlive us
            self.proc.kill()
            self.proc.wait()
            raise
        self.ready = json.loads(line) if line else {"event": "failed", "error": self.proc.stderr.read()}
        if self.ready.get("event") != "ready":
            self.stop()
            raise RuntimeError(f"engine ({load_format}) did not become ready: {self.ready.get('error')}")
        self.url = f"http://127.0.0.1:{self.ready['port']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.communicate(timeout=30)


SNAPSHOT = "snapshot restore"
RESTORE_TARGET_S = 0.5
RESTORE_OVER_WARM_TARGET = 4.0
IMAGE_SHARE_TARGET = 0.25


def measure(model: pathlib.Path, runtime_dir: pathlib.Path, repeats: int, drop_cache: bool = False,
            tp_size: int = 1, snapshot: dict | None = None, devices: str = "") -> dict:
    """{variant: [{"start_to_ready", "weights"}...]} for cold, warm (and cold from disk), and
    restores of `snapshot` (take_snapshot's) when given."""
    variants = {"cold (safetensors)": ("safetensors", False), "warm (ipc_cache)": ("ipc_cache", False)}
    if drop_cache:
        variants["cold, page cache dropped"] = ("safetensors", True)
    if snapshot is not None:
        variants[SNAPSHOT] = ("snapshot", False)
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fmt, drop) in variants.items():
            if fmt == "snapshot":
                samples[name].append(restore_once(snapshot["dir"], runtime_dir))
                continue
            if drop:
                drop_page_cache(model)
            extra = ("--no-fallback",) if fmt == "ipc_cache" else ()
            if devices:
                extra += ("--devices", devices)
            engine = Engine(model, fmt, runtime_dir, "--tp-size", str(tp_size), *extra)
            try:
                r = engine.ready
                samples[name].append({"start_to_ready": r["ready"] - r["process_start"],
                                      "weights": max(k["weights_done"] - k["weights_start"] for k in r["ranks"]),
                                      "load_format": r["load_format"]})
            finally:
                engine.stop()
    return samples


def take_snapshot(model: pathlib.Path, runtime_dir: pathlib.Path) -> dict | None:
    """A snapshot of a warm engine on `model` (its manifest and directory), or None where this host
    cannot snapshot (the reason goes to stderr). The first restore, which unpacks the image, is
    timed here and not among the samples."""
    from worker.criu import SnapshotError, check_host
    from worker.snapshot import create
    failed = [f"{c.name}: {c.detail}" for c in check_host() if not c.ok]
    if failed:
        print(f"no snapshot column: {'; '.join(failed)}", file=sys.stderr)
        return None
    engine = Engine(model, "ipc_cache", runtime_dir, "--no-fallback")
    directory = runtime_dir / "bench-snapshot"
    try:
        manifest = create(engine.url, directory, stop=True, runtime_dir=runtime_dir, log=lambda _: None)
    except SnapshotError as e:
        print(f"no snapshot column: {e}", file=sys.stderr)
        return None
    finally:
        engine.stop()
    return {"dir": directory, "manifest": manifest, "first_restore": restore_once(directory, runtime_dir)}


def restore_once(directory: pathlib.Path, runtime_dir: pathlib.Path) -> dict:
    """`preload snapshot restore --detach` from its spawn to the restored engine's ready; the weights
    phase is its re-attach."""
    spawned = time.time()
    run = subprocess.run([sys.executable, "-m", "preload_cli", "snapshot", "restore", str(directory), "--port", "0",
                          "--detach", "--runtime-dir", str(runtime_dir), "--log-level", "WARNING"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    if run.returncode:
        raise RuntimeError(f"snapshot restore failed: {run.stderr.strip()}")
    ready = json.loads(run.stdout.splitlines()[-1])
    with contextlib.suppress(ProcessLookupError):
        os.kill(ready["pid"], signal.SIGKILL)
    r = ready["restored"]
    return {"start_to_ready": r["ready"] - spawned, "weights": r["reattached"] - r["resume_start"],
            "load_format": "snapshot", "restore_command_to_wake": r["resume_start"] - spawned,
            "canary": r["canary"] - r["reattached"]}


ENGINE_IMPORTS = "import gc; gc.disable(); import preload_cli.main, preload_cli.engine_commands, worker.main"
"""What `preload engine` imports, as it does: with the collector held off until start-up is over."""
IMPORTS_TARGET = 1.1


def measure_imports(repeats: int) -> dict:
    """Seconds for a new interpreter to import what `preload engine` imports, against `import torch`,
    alternated; medians and their ratio."""
    runs: dict[str, list[float]] = {"import torch": [], "engine imports": [], "import torch, collector off": []}
    codes = {"import torch": "import torch", "engine imports": ENGINE_IMPORTS,
             "import torch, collector off": "import gc; gc.disable(); import torch"}  # shown for fairness
    for _ in range(repeats):
        for name, code in codes.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
            runs[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    return {"samples_s": runs, "median_s": medians, "target": IMPORTS_TARGET,
            "engine_over_torch": medians["engine imports"] / medians["import torch"]}


def imports_line(imports: dict) -> str:
    m = imports["median_s"]
    return (f"imports: engine {m['engine imports'] * 1e3:.0f} ms (the collector held off, as the engine starts), "
            f"bare `import torch` {m['import torch'] * 1e3:.0f} ms: {imports['engine_over_torch']:.2f}x (target <= "
            f"{imports['target']:g}x); `import torch` with the collector off: "
            f"{m['import torch, collector off'] * 1e3:.0f} ms")


def summarise(samples: dict) -> dict:
    out = {name: {"start_to_ready_s": statistics.median(s["start_to_ready"] for s in runs),
                  "weights_s": statistics.median(s["weights"] for s in runs), "n": len(runs)}
           for name, runs in samples.items()}
    cold, warm = out["cold (safetensors)"], out["warm (ipc_cache)"]
    out["ratios"] = {"start_to_ready_cold_over_warm": cold["start_to_ready_s"] / warm["start_to_ready_s"],
                     "weights_cold_over_warm": cold["weights_s"] / warm["weights_s"]}
    if SNAPSHOT in out:
        out["ratios"]["start_to_ready_warm_over_restore"] = warm["start_to_ready_s"] / out[SNAPSHOT]["start_to_ready_s"]
    return out


def table(summary: dict) -> str:
    lines = [f"{'start':<26} {'start -> ready':>15} {'weights phase':>14}"]
    for name, row in summary.items():
        if name != "ratios":
            lines.append(f"{name:<26} {row['start_to_ready_s'] * 1e3:>12.0f} ms {row['weights_s'] * 1e3:>11.1f} ms")
    ratios = summary["ratios"]
    lines.append(f"{'cold / warm':<26} {ratios['start_to_ready_cold_over_warm']:>14.2f}x "
                 f"{ratios['weights_cold_over_warm']:>13.1f}x")
    if SNAPSHOT in summary:
        restore = summary[SNAPSHOT]["start_to_ready_s"]
        lines.append(f"{'warm / snapshot restore':<26} {ratios['start_to_ready_warm_over_restore']:>14.2f}x "
                     f"(targets: >= {RESTORE_OVER_WARM_TARGET:g}x, restore <= {RESTORE_TARGET_S * 1e3:.0f} ms: "
                     f"{restore * 1e3:.0f} ms)")
    return "\n".join(lines)


def snapshot_lines(snapshot: dict) -> str:
    image = snapshot["manifest"]["image"]
    first = snapshot["first_restore"]["start_to_ready"]
    return (f"snapshot image: {image['bytes'] / 2**20:.1f} MiB stored ({image['unpacked_bytes'] / 2**20:.1f} MiB "
            f"unpacked) against {image['weight_bytes'] / 2**20:.1f} MiB of weights: "
            f"{image['bytes'] / image['weight_bytes']:.1%} (target < {IMAGE_SHARE_TARGET:.0%}); unpacked "
            f"{image['unpacked_bytes'] / image['weight_bytes']:.1%}\n"
            f"first restore on this host (unpacks the image once): {first * 1e3:.0f} ms to ready")


def with_daemon(model: pathlib.Path, name: str = "", tp_size: int = 1, kind: str = "cpu"):
    """Private daemons (KIND:0..KIND:TP-1, KIND cpu or cuda) holding `model`'s ranks, for the length
    of a `with` block."""
    from preload_daemon.plan import Layout
    from preload_daemon.supervisor import DaemonProcess
    from preload_daemon.versions import Target, publish_dir

    class Daemon:
        def __enter__(self):
            self.runtime_dir = pathlib.Path(tempfile.mkdtemp(prefix="plr-", dir="/tmp"))
            devices = [f"{kind}:{r}" for r in range(tp_size)]
            self.devices = ",".join(devices)
            self.processes = []
            try:
                for device in devices:
                    self.processes.append(DaemonProcess(device, self.runtime_dir, "WARNING"))
                    self.processes[-1].wait_started()
                targets = [Target(d, [Layout(tp_size=tp_size, tp_rank=r)]) for r, d in enumerate(devices)]
                published = publish_dir(name or model.name, str(model), targets, self.runtime_dir)
                self.infos = [variants[0] for variants in published.variants]
            except BaseException:
                self.__exit__()
                raise
            self.info = self.infos[0]
            return self

        def __exit__(self, *exc) -> None:
            for process in self.processes:
                process.stop()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    return Daemon()


def run(args) -> int:
    from preload_daemon.default_model import default_model_path
    if args.synthetic_gb:
        from preload_cli.models import bench_dir, synthetic_checkpoint
        model = bench_dir() / f"synthetic-{args.synthetic_gb:g}gb"  # as bench attach names it
        if not (model / "config.json").exists():
            print(f"building a {args.synthetic_gb:g} GB synthetic checkpoint in {model} ...", file=sys.stderr)
            synthetic_checkpoint(model, args.synthetic_gb)
    else:
        model = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    snapshots = args.tp_size == 1 and not args.no_snapshot and args.device_kind == "cpu"
    with with_daemon(model, tp_size=args.tp_size, kind=args.device_kind) as daemon:
        snapshot = take_snapshot(model, daemon.runtime_dir) if snapshots else None
        samples = measure(model, daemon.runtime_dir, args.repeats, args.drop_cache, args.tp_size, snapshot,
                          daemon.devices)
    summary = summarise(samples)
    imports = measure_imports(args.repeats)
    measured = machine.measure(model)
    slab_bytes = sum(info.slab_bytes for info in daemon.infos)
    if args.json:
        print(json.dumps({"model": str(model), "slab_bytes": slab_bytes, "tp_size": args.tp_size,
                          "devices": daemon.devices,
                          "repeats": args.repeats, "summary": summary, "samples": samples, "imports": imports,
                          "machine": measured,
                          "snapshot": {k: v for k, v in (snapshot or {}).items() if k != "dir"} or None},
                         indent=2, default=str))
    else:
        print(f"preload bench restart — {model.name} ({slab_bytes / 2**30:.2f} GiB over {args.tp_size} rank(s) on "
              f"{daemon.devices}), TP={args.tp_size}, median of {args.repeats}")
        print(machine.line(measured))
        print(table(summary))
        if snapshot is not None:
            print(snapshot_lines(snapshot))
        print(imports_line(imports))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--repeats", type=argtypes.repeats, default=5)
    parser.add_argument("--drop-cache", action="store_true", help="also time cold starts that read from disk")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks per engine (default 1; the "
                        "default model's 9 heads and 3 kv heads fit TP 1 and 3)")
    parser.add_argument("--synthetic-gb", type=argtypes.gigabytes_or_none, default=0.0,
                        help="instead of MODEL, a synthetic Llama-shaped checkpoint of this size (built once)")
    parser.add_argument("--no-snapshot", action="store_true", help="skip the snapshot restore column (TP 1 CPU "
                        "engines only; it needs CRIU and root: `preload snapshot check`)")
    parser.add_argument("--device-kind", choices=("cpu", "cuda"), default="cpu",
                        help="daemons and engines on cpu:0..N-1 (default) or cuda:0..N-1")
    parser.add_argument("--json", action="store_true")

