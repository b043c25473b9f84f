"""Argument types for the CLI's numbers, which argparse alone would take as any int or float: a
port past 65535 crashed the engine's server with a traceback, a timeout of nan or inf waited for
good, --keep -1 failed inside protobuf."""

import argparse
import math

from preload_daemon.errors import PreloadError

MAX_VERSION = 2**31 - 1
"""The daemon's largest version number (preload_daemon.records; not imported: the CLI's parsers load
neither torch nor grpc)."""


def port(text: str) -> int:
    value = _int(text, "a port")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: use 1-65535, or 0 to pick a free one")
    return value


MAX_SECONDS = 7 * 24 * 3600.0
"""Longest wait or timeout a flag takes: 1e10 s passed the parser and then overflowed the clock's
arithmetic deep in a snapshot, with the engine already quiet."""


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds, at most MAX_SECONDS (a week)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be a finite number from 0 to {MAX_SECONDS:.0f} "
                                         "(a week)")
    return value


MAX_SYNTHETIC_GB = 256.0
"""Largest synthetic checkpoint a benchmark builds (1e9 was taken, and built until memory ran out)."""


def gigabytes(text: str, zero: bool = False) -> float:
    """A synthetic checkpoint's size in GB: finite, in (0, MAX_SYNTHETIC_GB] (0 too if `zero`: none)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GB") from None
    if not (math.isfinite(value) and (0 < value <= MAX_SYNTHETIC_GB or zero and value == 0)):
        raise argparse.ArgumentTypeError(f"{text!r}: a size in GB must be a number in {'[' if zero else '('}0, "
                                         f"{MAX_SYNTHETIC_GB:g}]")
    return value


def gigabytes_or_none(text: str) -> float:
    """gigabytes(), where 0 (none) is taken too."""
    return gigabytes(text, zero=True)


def gigabytes_list(text: str) -> list[float]:
    """Comma-separated sizes in GB, each as gigabytes() takes it."""
    return [gigabytes(part) for part in text.split(",") if part.strip()]


def bounded(low: int, high: int, what: str):
    """An integer type in [low, high]."""
    def parse(text: str) -> int:
        value = _int(text, what)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value}: {what} must be in [{low}, {high}]")
        return value
    parse.__name__ = what  # argparse names the type in its own messages
    return parse


repeats = bounded(1, 1000, "repeats")
"""A benchmark's --repeats (0 failed in statistics after all the work)."""


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def split_target(target: str) -> tuple[str, int]:
    """MODEL or MODEL@VERSION: (name, version or 0)."""
    name, sep, version = target.rpartition("@")
    if not (name if sep else target):
        raise PreloadError(f"no model name in {target!r}; use MODEL or MODEL@N, e.g. llama@2")
    if not sep:
        return target, 0
    if not (version.isascii() and version.isdigit()) or not 1 <= int(version) <= MAX_VERSION:  # not '²'
        raise PreloadError(f"bad version {version!r} in {target!r}; use MODEL@N with 1 <= N <= {MAX_VERSION}, "
                           "e.g. llama@2, or MODEL alone for every version")
    return name, int(version)
