"""The `preload` console script: the daemon commands plus the engine commands."""

import sys

from preload_daemon import cli as daemon_cli


def main(argv=None) -> int:
    parser, _ = daemon_cli.build_parser()
    return daemon_cli.main(argv, parser)


if __name__ == "__main__":
    sys.exit(main())
