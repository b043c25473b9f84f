"""The bare daemon process: `python -m preload_daemon --device cpu:0`. One per device, in the
foreground, until SIGTERM/SIGINT. `preload serve` starts these; users normally run `preload daemon`."""

import argparse
import pathlib
import sys

from preload_daemon import daemon
from preload_daemon.config import LOG_LEVELS, DaemonConfig, configure_logging, default_runtime_dir
from preload_daemon.errors import PreloadError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preload_daemon",
                                     description="Run one per-device weight-cache daemon in the foreground.")
    parser.add_argument("--device", default="cpu:0", help="cpu:N or cuda:N (default cpu:0)")
    parser.add_argument("--runtime-dir", type=pathlib.Path, default=None,
                        help="private directory of sockets and logs (default: $PRELOAD_RUNTIME_DIR, "
                             "$XDG_RUNTIME_DIR/preload or /tmp/preload-$UID)")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve HTTP /health, /ready and /metrics on this port")
    parser.add_argument("--max-sessions", type=int, default=1024, help="attached processes at most (default 1024)")
    parser.add_argument("--load-timeout", type=float, default=3600.0, help="seconds a load may take (default 3600)")
    parser.add_argument("--threads", type=int, default=0,
                        help="compute threads for conversions and quantization (default 0: every core)")
    parser.add_argument("--allow-external-links", action="store_true",
                        help="load checkpoint files that link outside their directory (Hugging Face cache snapshots)")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return daemon.run(DaemonConfig(device=args.device, runtime_dir=args.runtime_dir or default_runtime_dir(),
                                       http_port=args.http_port, max_sessions=args.max_sessions,
                                       load_timeout_s=args.load_timeout,
                                       allow_external_links=args.allow_external_links, threads=args.threads)) or 0
    except PreloadError as e:
        print(f"preload daemon: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
