"""The GPU half of scripts/gpu_check.sh: on cuda:0 (and cuda:1 where visible), with a daemon that
holds a generated checkpoint in device memory:

- attach: a fresh process attaching to the resident model (IPC handles opened per attach, time);
- restarts: cold vs warm engine start to ready (`preload bench restart --device-kind cuda`);
- linear: each quantization scheme's linear against bf16 at decode (M=1) and prefill (M=256)
  sizes, each checked against the CPU reference (the tolerance of tests/kernels/test_quant.py);
- TP: greedy tokens of a generated float32 checkpoint (32 heads) at TP=1 and TP=2 (two GPUs),
  which must be equal.

Writes the JSON summary (the path given) after each part, so a timeout keeps what was measured,
and prints each part as a line.

    python scripts/gpu_bench.py --out gpu-check/bench.json [--gb 4] [--repeats 3]
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINEAR_TOLERANCE = 0.1  # of the largest output: FP8 on tensor cores also quantizes the activations


def attach_child(socket_path: str, model: str) -> None:
    """Runs in a fresh process: one attach, timed, as a JSON line."""
    from preload_daemon.client import DaemonClient
    start = time.perf_counter()
    client = DaemonClient(socket_path)
    client.device = "cuda:0"
    attached = client.attach(model)
    tensors = attached.tensors
    seconds = time.perf_counter() - start
    opened = len(attached.manifest.slabs)
    devices = sorted({str(t.device) for t in tensors.values()})
    attached.close()
    print(json.dumps({"seconds": seconds, "ipc_opens": opened, "tensors": len(tensors), "devices": devices}))


def checkpoint(gb: float) -> pathlib.Path:
    """The generated checkpoint the attach and restart parts share (built once)."""
    from preload_cli.models import synthetic_checkpoint
    model = pathlib.Path(tempfile.gettempdir()) / f"preload-gpu-check-{gb:g}gb"
    if not (model / "config.json").exists():
        synthetic_checkpoint(model, gb)
    return model


def attach_rows(gb: float, repeats: int) -> dict:
    from preload_daemon.runtime_dir import socket_path
    from preload_daemon.supervisor import DaemonProcess
    from preload_daemon.versions import Target, publish_dir
    from preload_daemon.plan import Layout
    model = checkpoint(gb)
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="plg-", dir="/tmp"))
    daemon = DaemonProcess("cuda:0", runtime, "WARNING")
    try:
        daemon.wait_started()
        start = time.perf_counter()
        published = publish_dir(model.name, str(model), [Target("cuda:0", [Layout()])], runtime)
        load_s = time.perf_counter() - start
        info = published.variants[0][0]
        samples = []
        for _ in range(repeats):
            run = subprocess.run([sys.executable, __file__, "--attach-child", str(socket_path(runtime, "cuda:0")),
                                  model.name], capture_output=True, text=True, timeout=60, cwd=ROOT)
            if run.returncode:
                raise RuntimeError(f"attach failed: {run.stderr[-2000:]}")
            samples.append(json.loads(run.stdout.strip().splitlines()[-1]))
    finally:
        daemon.stop()
    return {"model": str(model), "slab_gib": info.slab_bytes / 2**30, "tensors": info.num_tensors,
            "daemon_load_s": load_s, "attach_ms": statistics.median(s["seconds"] for s in samples) * 1e3,
            "ipc_opens_per_attach": samples[0]["ipc_opens"], "view_devices": samples[0]["devices"]}


def restart_rows(gb: float, repeats: int) -> dict:
    run = subprocess.run([sys.executable, "-m", "preload_cli", "bench", "restart", str(checkpoint(gb)),
                          "--device-kind", "cuda", "--no-snapshot", "--repeats", str(repeats), "--json"],
                         capture_output=True, text=True, timeout=150, cwd=ROOT)
    if run.returncode:
        raise RuntimeError(f"bench restart failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout)["summary"]


def linear_rows(repeats: int) -> dict:
    import torch
    import torch.nn.functional as F
    from kernels.linear import quantized_linear, reference_linear
    from kernels.quant import SCHEMES, QuantizedWeight, quantize

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(repeats, 5)):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    n = k = 4096
    w = torch.randn(n, k) * 0.02
    wg = w.to(torch.bfloat16).cuda()
    rows, failed = {}, []
    for m in (1, 256):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        xg = x.cuda()
        bf16 = timed(lambda: F.linear(xg, wg))
        for scheme in SCHEMES:
            q = quantize(w, scheme)
            qg = QuantizedWeight(q.scheme, q.weight.cuda(), q.scale.cuda(),
                                 None if q.global_scale is None else q.global_scale.cuda(), q.shape)
            out = quantized_linear(xg, qg).float().cpu()
            ref = reference_linear(x, q).float()
            error = float((out - ref).abs().max() / ref.abs().max())
            seconds = timed(lambda: quantized_linear(xg, qg))
            rows[f"{scheme} M={m}"] = {"ms": seconds * 1e3, "vs_bf16": seconds / bf16, "max_rel_error": error}
            if not error <= LINEAR_TOLERANCE:
                failed.append(f"{scheme} M={m}: error {error:.3g} of the largest output")
    if failed:
        rows["failed"] = failed
    return rows


def tp_rows() -> dict:
    import torch
    from preload_cli.models import synthetic_checkpoint
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible; TP=2 needs two"}
    model = pathlib.Path(tempfile.gettempdir()) / "preload-gpu-check-tp"
    if not (model / "config.json").exists():
        synthetic_checkpoint(model, 0.5)  # hidden 2048, 32 heads: splits in two
    out = {}
    for tp, devices in ((1, "cuda:0"), (2, "cuda:0,cuda:1")):
        run = subprocess.run([sys.executable, "-m", "preload_cli", "generate", str(model), "--prompt-ids", "1,2,3,4",
                              "--max-tokens", "8", "--dtype", "float32", "--tp-size", str(tp), "--devices", devices,
                              "--load-format", "safetensors"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        if run.returncode:
            raise RuntimeError(f"generate at TP={tp} failed: {run.stderr[-2000:]}")
        out[f"tp{tp}"] = json.loads(run.stdout)["token_ids"]
    out["equal"] = out["tp1"] == out["tp2"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--gb", type=float, default=4.0, help="size of the generated checkpoint (default 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attach-child", nargs=2, metavar=("SOCKET", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attach_child:
        attach_child(*args.attach_child)
        return 0
    summary, failed = {}, []
    for name, part in (("attach", lambda: attach_rows(args.gb, args.repeats)),
                       ("restart", lambda: restart_rows(args.gb, args.repeats)),
                       ("linear", lambda: linear_rows(args.repeats)), ("tp", tp_rows)):
        try:
            summary[name] = part()
        except Exception as e:  # every part runs and reports, whatever another did
            summary[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        print(f"{name}: {json.dumps(summary[name], default=str)}", flush=True)
        if summary[name].get("failed"):
            failed.append(f"{name}: {'; '.join(summary[name]['failed'])}")
        if summary[name].get("equal") is False:
            failed.append(f"{name}: TP=1 and TP=2 tokens differ")
        summary["failed"] = failed
        args.out.write_text(json.dumps(summary, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
