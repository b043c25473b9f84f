"""`preload bench attach`: how long a fresh process takes to attach to a resident model, against
loading the same checkpoint cold, for synthetic checkpoints of about 0.1, 1 and 4 GB and one of
20,000 small tensors (the tensor table of the largest models); and how close the cold load comes
to a raw sequential read of the same files, from disk and from the page cache, at TP=1 and TP=2.

Every sample runs in its own new process (imports not timed). "disk" samples first drop the files
from the page cache (posix_fadvise DONTNEED); "cached" samples read them once first. One daemon
holds all sizes, and loads each --repeats times (its load_seconds: the slab made, filled and
hashed). Targets: attach <= 5 ms + 5 us per tensor; cold load >= 85% of the raw read's
throughput; each TP=2 rank reads about half of the files. Beside the raw read into one reused
buffer (the targets' reference) stands one into a new mapping of the files' whole size ("fresh"),
from disk and from the page cache: a load writes into memory no one has touched yet, and what
faulting that in costs varies widely between machines (on VMs whose host takes freed memory back
it can exceed the read itself). With --quantization, every load (the daemon's, the cold path's,
both TP ranks') quantizes its projections with that scheme, and the attaches map the quantized
slabs; the cold load's GB/s are always of the checkpoint's files, as the raw read's are.

    preload bench attach [--sizes-gb 0.1,1,4] [--tensors 20000] [--tp-gb 1] [--quantization none]
                         [--repeats 5] [--json]
"""

import argparse
import json
import mmap
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from preload_cli import argtypes
from preload_cli.bench import machine
from preload_daemon.arch import SCHEMES

ROOT = pathlib.Path(__file__).resolve().parents[2]
ATTACH_FIXED_MS, ATTACH_PER_TENSOR_MS, COLD_SHARE = 5.0, 0.005, 0.85


def child_attach(socket_path: str, model: str) -> dict:
    from preload_daemon.client import DaemonClient
    start = time.perf_counter()
    client = DaemonClient(socket_path)
    attached = client.attach(model)
    first = attached[next(iter(attached))].view(-1)[0].item()  # a first element read through the mapping
    elapsed = time.perf_counter() - start
    views = len(attached.tensors)  # every tensor's view, as an engine building its model asks for them
    every = time.perf_counter() - start
    attached.release()
    return {"seconds": elapsed, "all_views_seconds": every, "num_tensors": views, "first": float(first)}


def child_cold(path: str, cache: str, quantization: str = "none", tp_size: str = "1", tp_rank: str = "0",
               start_on_go: str = "") -> dict:
    import torch
    from preload_daemon.config import core_share
    from preload_daemon.plan import LoadSpec
    from worker.loader import read_cold
    _set_cache(pathlib.Path(path), cache)
    threads = core_share(int(tp_size))  # each rank its share, as an engine's ranks and serve's daemons have
    if threads:
        torch.set_num_threads(threads)
    if start_on_go:  # the ranks of a TP sample start together, once both have imported torch
        print("ready", flush=True)
        sys.stdin.readline()
    read_before = _bytes_read()
    start = time.perf_counter()
    spec = LoadSpec(path=path, quantization=quantization, tp_size=int(tp_size), tp_rank=int(tp_rank))
    plan, _, _ = read_cold(spec)  # the engine's cold path
    return {"seconds": time.perf_counter() - start, "bytes": plan.tensor_bytes, "read": _bytes_read() - read_before}


def child_raw(path: str, cache: str, into: str = "reused") -> dict:
    """A raw sequential read of the same files, on one thread: into one reused 16 MiB buffer (the
    floor for any loader), or (`into` "fresh") into one new private mapping of their whole size, as
    a load must write them into memory it has not touched."""
    _set_cache(pathlib.Path(path), cache)
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    start, total = time.perf_counter(), 0
    if into == "fresh":
        size = sum(f.stat().st_size for f in files)
        buf = memoryview(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    else:
        buf = memoryview(bytearray(16 << 20))
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf[total:total + (16 << 20)] if into == "fresh" else buf):
                total += n
    return {"seconds": time.perf_counter() - start, "bytes": total}


def _bytes_read() -> int:
    """Bytes this process read with read system calls (from disk or page cache): /proc/self/io rchar."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _set_cache(path: pathlib.Path, cache: str) -> None:
    """Drops the files from the page cache ("disk"), reads them into it ("cached"), or neither."""
    if cache == "disk":
        drop_page_cache(path)
    if cache != "cached":
        return
    buf = bytearray(16 << 20)
    for f in path.glob("*.safetensors"):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def drop_page_cache(path: pathlib.Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def sample(*args: str) -> dict:
    return json.loads(_child(*args).communicate_json())


class _child:
    def __init__(self, *args: str):
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "preload_cli.bench.attach", "--child", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=ROOT)

    def communicate_json(self) -> str:
        out, err = self.proc.communicate("")
        if self.proc.returncode:
            raise RuntimeError(f"benchmark child {self.args} failed:\n{err}")
        return out.strip().splitlines()[-1]


def tp2_sample(path: str, cache: str, quantization: str) -> dict:
    """Both ranks of a TP=2 cold load at once, each in its own process: wall time from the common
    start to the last rank done, and the bytes each read."""
    _set_cache(pathlib.Path(path), cache)
    children = [_child("cold", path, "as-is", quantization, "2", str(rank), "go") for rank in range(2)]
    for child in children:
        if child.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"benchmark child {child.args} failed:\n{child.proc.communicate()[1]}")
    for child in children:
        child.proc.stdin.write("go\n")
        child.proc.stdin.flush()
    results = [json.loads(c.communicate_json()) for c in children]
    return {"seconds": max(r["seconds"] for r in results), "read": [r["read"] for r in results]}


def _median(samples: list[dict], key: str = "seconds") -> float:
    return statistics.median(s[key] for s in samples)


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
    from preload_daemon.supervisor import DaemonProcess
    from preload_cli.models import bench_dir, synthetic_checkpoint

    work = bench_dir()
    checkpoints = [(f"synthetic-{gb:g}gb", gb, 0) for gb in args.sizes_gb]
    if args.tensors:
        checkpoints.append((f"synthetic-{args.tensors}-tensors", 0.0, args.tensors))
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="plb-", dir="/tmp"))
    rows, tp_row, daemon = [], None, None
    try:
        daemon = DaemonProcess("cpu:0", runtime, "WARNING")
        daemon.wait_started()  # bounded: a daemon that fails to start is reported with its log's tail
        socket_path = daemon.config.socket_path
        client = DaemonClient(socket_path, timeout=3600)
        for name, gb, num_tensors in checkpoints:
            path = work / name
            if not (path / "config.json").exists():
                print(f"building {name} in {path} ...", file=sys.stderr)
                synthetic_checkpoint(path, gb, num_tensors=num_tensors)
            spec = LoadSpec(path=str(path), name=name, quantization=args.quantization)
            info = client.load(spec)
            files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            attach = [sample("attach", str(socket_path), info.name) for _ in range(args.repeats)]
            row = {"name": name, "size_gb": info.slab_bytes / 1e9, "files_gb": files / 1e9,
                   "num_tensors": info.num_tensors,
                   "daemon_load_s": info.load_seconds, "attach_ms": [s["seconds"] * 1e3 for s in attach],
                   "all_views_ms": [s["all_views_seconds"] * 1e3 for s in attach]}
            row["attach_ms_median"] = statistics.median(row["attach_ms"])
            row["all_views_ms_median"] = statistics.median(row["all_views_ms"])
            row["attach_target_ms"] = ATTACH_FIXED_MS + ATTACH_PER_TENSOR_MS * info.num_tensors
            loads = [info.load_seconds]
            for _ in range(args.repeats - 1):  # the daemon's load again (the files now in the page cache)
                client.evict(info.name, force=True)
                loads.append(client.load(spec).load_seconds)
            row["daemon_load_s_median"] = statistics.median(loads)
            client.evict(info.name, force=True)
            for cache in ("disk", "cached"):
                # Interleaved, so that the machine's drift (this kind of VM's memory and disk swing
                # 2x between minutes) falls on the three alike.
                cold, raw, fresh = [], [], []
                for _ in range(args.repeats):
                    cold.append(sample("cold", str(path), cache, args.quantization))
                    raw.append(sample("raw", str(path), cache))
                    fresh.append(sample("raw", str(path), cache, "fresh"))
                row[f"cold_{cache}_s"] = [s["seconds"] for s in cold]
                row[f"raw_{cache}_s"] = [s["seconds"] for s in raw]
                row[f"fresh_{cache}_s"] = [s["seconds"] for s in fresh]
                row[f"cold_{cache}_GBps"] = files / _median(cold) / 1e9
                row[f"raw_{cache}_GBps"] = raw[0]["bytes"] / _median(raw) / 1e9
                row[f"fresh_{cache}_GBps"] = fresh[0]["bytes"] / _median(fresh) / 1e9
                row[f"cold_share_{cache}"] = row[f"cold_{cache}_GBps"] / row[f"raw_{cache}_GBps"]
                row[f"cold_share_fresh_{cache}"] = row[f"cold_{cache}_GBps"] / row[f"fresh_{cache}_GBps"]
            row["cold_over_attach"] = statistics.median(row["cold_disk_s"]) * 1e3 / row["attach_ms_median"]
            rows.append(row)
            if args.tp_gb and gb == args.tp_gb:
                tp_row = tp2(path, args.repeats, row, args.quantization)
    finally:
        if daemon is not None:
            daemon.stop()  # a graceful stop: the daemon frees its slabs and removes its /dev/shm directory
        shutil.rmtree(runtime, ignore_errors=True)
    result = {"machine": machine.measure(), "repeats": args.repeats, "quantization": args.quantization,
              "rows": rows, "tp2": tp_row,
              "targets": {"attach_ms": f"{ATTACH_FIXED_MS:g} + {ATTACH_PER_TENSOR_MS * 1e3:g} us x tensors",
                          "cold_share": COLD_SHARE}, "digest_GBps": digest_throughput()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)
    return 0


def tp2(path: pathlib.Path, repeats: int, row: dict, quantization: str) -> dict:
    """The TP=2 row: both ranks loading at once against one raw read of all the files."""
    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    out = {"name": path.name, "file_bytes": files}
    for cache in ("disk", "cached"):
        samples = [tp2_sample(str(path), cache, quantization) for _ in range(repeats)]
        out[f"{cache}_s"] = [s["seconds"] for s in samples]
        out[f"{cache}_GBps"] = files / 1e9 / _median(samples)
        out[f"share_{cache}"] = out[f"{cache}_GBps"] / row[f"raw_{cache}_GBps"]
        out["read_share_per_rank"] = [r / files for r in samples[-1]["read"]]
    return out


def report(result: dict) -> None:
    quantized = "" if result["quantization"] == "none" else f", every load quantized to {result['quantization']}"
    print(f"preload bench attach — median of {result['repeats']}, each sample a new process{quantized}")
    print(machine.line(result["machine"]))
    print(f"{'':>61} │ {'from disk (GB/s)':^33} │ {'from the page cache (GB/s)':^33} │")
    print(f"{'checkpoint':>24} {'tensors':>7} {'attach':>9} {'target':>8} {'+views':>9} │ "
          f"{'cold':>6} {'raw':>6} {'share':>6} {'fresh':>6} {'share':>6} │ "
          f"{'cold':>6} {'raw':>6} {'share':>6} {'fresh':>6} {'share':>6} │ {'cold/attach':>11}")
    for r in result["rows"]:
        shares = " │ ".join(f"{r[f'cold_{c}_GBps']:>6.2f} {r[f'raw_{c}_GBps']:>6.2f} {r[f'cold_share_{c}']:>6.0%} "
                           f"{r[f'fresh_{c}_GBps']:>6.2f} {r[f'cold_share_fresh_{c}']:>6.0%}"
                           for c in ("disk", "cached"))
        print(f"{r['name']:>24} {r['num_tensors']:>7} {r['attach_ms_median']:>7.2f}ms {r['attach_target_ms']:>6.1f}ms "
              f"{r['all_views_ms_median']:>7.2f}ms │ {shares} │ {r['cold_over_attach']:>10.0f}x")
    print(f"targets: attach <= {result['targets']['attach_ms']}; cold load share of the raw read >= "
          f"{COLD_SHARE:.0%} (disk and cached); +views: attach plus a view of every tensor; raw: one thread reading "
          "the files into one reused buffer; fresh: the same into new memory of the files' size (what faulting "
          "memory in costs here), and the cold load's share of it")
    print("the daemon's load into a slab, hashed (median; the first from whatever the page cache held): " + ", ".join(
        f"{r['name']} {r['daemon_load_s_median'] * 1e3:.0f} ms ({r['files_gb'] / r['daemon_load_s_median']:.2f} GB/s)"
        for r in result["rows"]))
    tp = result["tp2"]
    if tp:
        print(f"TP=2, {tp['name']}, both ranks at once: disk {tp['disk_GBps']:.2f} GB/s ({tp['share_disk']:.0%} of "
              f"the raw read), cached {tp['cached_GBps']:.2f} GB/s ({tp['share_cached']:.0%}); each rank read "
              + " and ".join(f"{s:.0%}" for s in tp["read_share_per_rank"]) + " of the files (target about 50%)")
    print("digest GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in result["digest_GBps"].items()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-gb", type=argtypes.gigabytes_list, default="0.1,1,4",
                        help="checkpoint sizes, comma-separated")
    parser.add_argument("--tensors", type=argtypes.bounded(0, 1_000_000, "tensors"), default=20000,
                        help="tensors of the many-tensor row (0: none)")
    parser.add_argument("--tp-gb", type=argtypes.gigabytes_or_none, default=1.0,
                        help="size whose TP=2 row to add (0: none)")
    parser.add_argument("--quantization", default="none", choices=SCHEMES,
                        help="quantize every load's projections with this scheme")
    parser.add_argument("--repeats", type=argtypes.repeats, default=5)
    parser.add_argument("--json", action="store_true")


if __name__ == "__main__":  # one sample in a fresh process: `python -m preload_cli.bench.attach --child KIND ARGS`
    kind, rest = sys.argv[2], sys.argv[3:]
    print(json.dumps({"attach": child_attach, "cold": child_cold, "raw": child_raw}[kind](*rest)))
