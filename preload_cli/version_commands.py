"""The version commands of `preload`: publish, rollback, pin, unpin. They drive every daemon of
the runtime directory that holds the model (preload_daemon.versions) and print one line per
outcome, or JSON with --json."""

import argparse
import json
import re
import sys
import time
from collections.abc import Mapping

from preload_cli.argtypes import MAX_VERSION, bounded, split_target
from preload_daemon.arch import DTYPE_CHOICES, SCHEMES
from preload_daemon.config import resolve_devices
from preload_daemon.errors import PreloadError

EPILOG_PUBLISH = """examples:
  preload publish llama --from /ckpt/step-400            # next version, same variants and ranks as the active one
  preload publish llama --from /ckpt/step-400 --keep 3   # keep 3 older versions to roll back to
  preload publish llama --from /ckpt/step-400 --max-bytes 40G
  preload publish llama --from /ckpt/base --tp-size 2 --devices cpu:0,cpu:1 --quantization int8
"""
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """'40G', '512MiB', '1048576' -> bytes (K, M, G, T are powers of 1024)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a suffix, e.g. 512M or 40G")
    return int(float(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " "))


def model_at_version(text: str) -> tuple[str, int]:
    """NAME@VERSION, the version required (split_target's rules)."""
    try:
        name, version = split_target(text)
    except PreloadError:
        name, version = "", 0
    if not name or not version:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME@VERSION, e.g. llama@3 (see `preload status`)")
    return name, version


def add_arguments(sub, helps: Mapping[str, str]) -> None:
    """The version commands' parsers, under the top-level subparsers `sub`; `helps`: each command's
    one-line help (preload_cli.main.HELP)."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("publish", help=helps["publish"],
                       epilog=EPILOG_PUBLISH, formatter_class=raw)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--from", dest="source", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="variants to build (default: those of the active version)")
    p.add_argument("--quantization", default=None, choices=SCHEMES)
    p.add_argument("--tp-size", type=int, default=None)
    p.add_argument("--devices", default="", help="one per rank (default: the daemons holding NAME)")
    add_retention(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("rollback", help=helps["rollback"],
                       epilog="examples:\n  preload rollback llama --to 3", formatter_class=raw)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--to", dest="version", type=bounded(1, MAX_VERSION, "a version"), required=True, metavar="V")
    p.set_defaults(func=cmd_rollback)

    for command, pinned in (("pin", True), ("unpin", False)):
        p = sub.add_parser(command, help=helps[command],
                           epilog=f"examples:\n  preload {command} llama@3", formatter_class=raw)
        p.add_argument("target", type=model_at_version, metavar="NAME@V")
        p.set_defaults(func=cmd_pin, pinned=pinned)


def add_retention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep", type=bounded(0, MAX_VERSION, "versions to keep"), default=None, metavar="K",
                   help="older versions kept for rollback when not pinned, leased or active (default: as last "
                        "set for the model, 2 at first)")
    p.add_argument("--max-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="budget of all the model's versions per device, e.g. 40G (0: none); a load that does not "
                        "fit frees the oldest unpinned, unleased versions or fails")


def cmd_publish(args) -> int:
    from preload_daemon.plan import Layout
    from preload_daemon.versions import targets_for, publish_dir

    explicit = args.dtype or args.quantization or args.tp_size or args.devices
    devices = layouts = None
    if explicit:
        tp = args.tp_size or 1
        devices = resolve_devices(args.devices, tp)
        layouts = [Layout(dtype=args.dtype or "auto", quantization=args.quantization or "none", tp_size=tp, tp_rank=r)
                   for r in range(tp)]
    started = time.monotonic()
    targets = targets_for(args.name, args.runtime_dir, devices, layouts)
    try:
        published = publish_dir(args.name, args.source, targets, args.runtime_dir, keep=args.keep,
                                max_bytes=args.max_bytes, show_progress=not args.json)
    except KeyboardInterrupt:
        what = (f"interrupted; the daemons ({', '.join(t.device for t in targets)}) finish the load under way and "
                f"keep it as a version of {args.name} that is not active: `preload status` shows it, "
                f"`preload evict {args.name}@VERSION` frees it")
        if args.json:
            print(json.dumps({"error": what}), flush=True)
        print(f"preload publish: {what}", file=sys.stderr)
        raise
    version, results = published.version, published.variants
    variants = [v for rows in results for v in rows]
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps({"model": args.name, "version": version, "created": published.created, "active": True,
                          "seconds": round(seconds, 3),
                          "devices": [t.device for t in targets],
                          "variants": [{"device": t.device, "tp_rank": v.key.tp_rank, "dtype": v.key.dtype,
                                        "quantization": v.key.quantization, "bytes": v.slab_bytes,
                                        "digest": v.key.content_digest}
                                       for t, rows in zip(targets, results) for v in rows]}))
    elif not published.created:
        print(f"{args.name} v{version} was already loaded from these files on {', '.join(t.device for t in targets)}; "
              "it is active now")
    else:
        print(f"published {args.name} v{version} on {', '.join(t.device for t in targets)}: {len(variants)} "
              f"variant(s), {sum(v.slab_bytes for v in variants) / 2**20:.1f} MiB in {seconds:.2f}s; active now")
    return 0


def cmd_rollback(args) -> int:
    from preload_daemon.versions import rollback
    devices = rollback(args.name, args.version, args.runtime_dir)
    print(f"{args.name}: v{args.version} is active on {', '.join(devices)}; engines started with "
          f"--weights-version active (or on its files) now attach to it")
    return 0


def cmd_pin(args) -> int:
    from preload_daemon.versions import set_pinned
    name, version = args.target
    devices = set_pinned(name, version, args.pinned, args.runtime_dir)
    print(f"{name} v{version} {'pinned' if args.pinned else 'unpinned'} on {', '.join(devices)}",
          file=sys.stdout)
    return 0
