import sys

from preload_daemon.cli import main

sys.exit(main())
