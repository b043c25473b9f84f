"""`preload bench attach`: how long a fresh process takes to attach to a resident model, against
reading the same checkpoint cold, for synthetic checkpoints of about 0.1, 1 and 4 GB.

Every sample runs in its own new process (imports not timed). Cold reads first drop the files from
the page cache (posix_fadvise DONTNEED), so they include the disk. One daemon holds all sizes.

    preload bench attach [--sizes-gb 0.1,1,4] [--repeats 5] [--json]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def child_attach(socket_path: str, model: str) -> dict:
    from preload_daemon.client import DaemonClient
    start = time.perf_counter()
    client = DaemonClient(socket_path)
    attached = client.attach(model)
    first = next(iter(attached.values()))[0].clone()  # the first byte read through the mapping
    elapsed = time.perf_counter() - start
    attached.release()
    return {"seconds": elapsed, "num_tensors": len(attached), "first": float(first.flatten()[0])}


def child_cold(path: str) -> dict:
    import torch
    from preload_daemon.checkpoint import Checkpoint
    from preload_daemon.execute import execute
    from preload_daemon.plan import LoadSpec, build_plan
    drop_page_cache(pathlib.Path(path))
    start = time.perf_counter()
    checkpoint = Checkpoint(path)
    plan = build_plan(checkpoint, LoadSpec(path=path))
    dest = torch.empty(plan.total_bytes, dtype=torch.uint8)
    execute(plan, checkpoint, dest)
    return {"seconds": time.perf_counter() - start, "bytes": plan.tensor_bytes}


def child_raw(path: str) -> dict:
    """A raw sequential read of the same files: the floor for any loader."""
    drop_page_cache(pathlib.Path(path))
    start, total = time.perf_counter(), 0
    buf = bytearray(16 << 20)
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return {"seconds": time.perf_counter() - start, "bytes": total}


def drop_page_cache(path: pathlib.Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def sample(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "preload_cli.bench.attach", "--child", *args], capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"benchmark child {args} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def digest_throughput(nbytes: int = 1 << 30) -> dict:
    """GB/s of the slab digest (xxh3_128) next to the usual cryptographic hashes, on one buffer."""
    import hashlib
    import xxhash
    data = memoryview(os.urandom(64 << 20) * (nbytes // (64 << 20)))
    rates = {}
    for name, make in (("xxh3_128", xxhash.xxh3_128), ("blake2b", hashlib.blake2b), ("sha256", hashlib.sha256)):
        start = time.perf_counter()
        make(data).hexdigest()
        rates[name] = nbytes / (time.perf_counter() - start) / 1e9
    return rates


def run(args) -> int:
    from preload_daemon.client import DaemonClient
    from preload_daemon.plan import LoadSpec
    from preload_cli.models import synthetic_checkpoint

    sizes = [float(s) for s in args.sizes_gb.split(",")]
    work = pathlib.Path(os.environ.get("PRELOAD_BENCH_DIR", "/tmp/preload-bench"))
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="plb-", dir="/tmp"))
    daemon = subprocess.Popen([sys.executable, "-m", "preload_daemon", "--runtime-dir", str(runtime), "--log-level",
                               "WARNING"], cwd=ROOT)
    rows = []
    try:
        socket_path = runtime / "daemon-cpu-0.sock"
        while not socket_path.exists():
            time.sleep(0.05)
        client = DaemonClient(socket_path, timeout=3600)
        for gb in sizes:
            path = work / f"synthetic-{gb:g}gb"
            if not (path / "config.json").exists():
                print(f"building a {gb:g} GB synthetic checkpoint in {path} ...", file=sys.stderr)
                synthetic_checkpoint(path, gb)
            info = client.load(LoadSpec(path=str(path), name=f"synthetic-{gb:g}gb"))
            attach = [sample("attach", str(socket_path), info.name) for _ in range(args.repeats)]
            cold = [sample("cold", str(path)) for _ in range(args.repeats)]
            raw = [sample("raw", str(path)) for _ in range(args.repeats)]
            row = {"size_gb": info.slab_bytes / 1e9, "num_tensors": info.num_tensors,
                   "daemon_load_s": info.load_seconds,
                   "attach_ms": [s["seconds"] * 1e3 for s in attach], "cold_s": [s["seconds"] for s in cold],
                   "raw_read_s": [s["seconds"] for s in raw]}
            row["attach_ms_median"] = statistics.median(row["attach_ms"])
            row["cold_s_median"] = statistics.median(row["cold_s"])
            row["raw_read_s_median"] = statistics.median(row["raw_read_s"])
            row["cold_over_attach"] = row["cold_s_median"] * 1e3 / row["attach_ms_median"]
            row["cold_GBps"] = info.slab_bytes / row["cold_s_median"] / 1e9
            row["raw_GBps"] = info.slab_bytes / row["raw_read_s_median"] / 1e9
            rows.append(row)
            client.evict(info.name, force=True)
    finally:
        daemon.terminate()
        daemon.wait()
    result = {"machine": machine(), "repeats": args.repeats, "rows": rows, "digest_GBps": digest_throughput()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"preload bench attach — {result['machine']}, median of {args.repeats}, each sample a new process")
        print(f"{'size':>8} {'tensors':>8} {'attach':>10} {'cold load':>10} {'raw read':>9} {'cold/attach':>12} "
              f"{'cold GB/s':>10} {'raw GB/s':>9}")
        for r in rows:
            print(f"{r['size_gb']:>6.2f}GB {r['num_tensors']:>8} {r['attach_ms_median']:>8.2f}ms "
                  f"{r['cold_s_median']:>9.2f}s {r['raw_read_s_median']:>8.2f}s {r['cold_over_attach']:>11.0f}x "
                  f"{r['cold_GBps']:>10.2f} {r['raw_GBps']:>9.2f}")
        print("digest GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in result["digest_GBps"].items()))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-gb", default="0.1,1,4", help="checkpoint sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")


def machine() -> str:
    """The machine a figure was measured on: architecture, cores, widest SIMD, memory."""
    import platform
    import psutil
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, {simd}, " \
           f"{psutil.virtual_memory().total / 2**30:.0f} GiB"


if __name__ == "__main__":  # one sample in a fresh process: `python -m preload_cli.bench.attach --child KIND ARGS`
    kind, rest = sys.argv[2], sys.argv[3:]
    print(json.dumps({"attach": child_attach, "cold": child_cold, "raw": child_raw}[kind](*rest)))
