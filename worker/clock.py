"""When this process started, by the kernel's account (what readiness timings count from)."""

import os
import time


def process_start_time() -> float:
    """When this process started, as a wall-clock timestamp, to the kernel's 10 ms tick.
    (psutil's create_time adds the boot time, which /proc/stat rounds to whole seconds.)"""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
