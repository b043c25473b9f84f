"""A separate process that attaches to a model as a worker would and reports what it saw, as one
JSON line on stdout. It then holds its lease until stdin closes (or exits at once with --exit).

    python -m tests.daemon.attach_probe SOCKET MODEL [--compare DIR] [--touch] [--exit]
"""

import argparse
import json
import sys

import psutil
import torch

from preload_daemon.client import DaemonClient
from preload_daemon.errors import PreloadError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("model")
    parser.add_argument("--compare", help="checkpoint dir whose tensors must equal the attached ones")
    parser.add_argument("--touch", action="store_true", help="read every byte of every slab")
    parser.add_argument("--exit", action="store_true")
    args = parser.parse_args()
    proc = psutil.Process()
    uss_before = proc.memory_full_info().uss
    report = {"pid": proc.pid}
    try:
        model = DaemonClient(args.socket).attach(args.model)
    except PreloadError as e:
        print(json.dumps({**report, "error": type(e).__name__, "message": str(e)}), flush=True)
        sys.exit(3)
    report.update(lease=model.lease_id, version=model.version, num_tensors=len(model),
                  slab_bytes=sum(s.numel() for s in model.slabs.values()))
    if args.touch:
        report["checksum"] = sum(int(s.sum()) for s in model.slabs.values())
    if args.compare:
        from safetensors.torch import load_file
        import pathlib
        ref = {}
        for f in sorted(pathlib.Path(args.compare).glob("*.safetensors")):
            ref.update(load_file(str(f)))
        report["equal"] = set(ref) == set(model) and all(
            torch.equal(model[n].view(torch.uint8), ref[n].view(torch.uint8)) for n in ref)
        report["shares_storage"] = all(t.untyped_storage().data_ptr() == next(iter(model.slabs.values())).data_ptr()
                                       for t in model.values())
    info = proc.memory_full_info()
    report.update(uss_before=uss_before, uss=info.uss, pss=info.pss, rss=info.rss)
    print(json.dumps(report), flush=True)
    if not args.exit:
        sys.stdin.read()
    model.release()


if __name__ == "__main__":
    main()
