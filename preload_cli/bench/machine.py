"""The machine a benchmark's figures were measured on, printed beside them: the CPU, its cores and
widest SIMD, the native kernel variant in use, the memory, and two bandwidths measured in the same
run: memory (summing a buffer far larger than the caches) and a sequential read of the benchmark's
own checkpoint files from the page cache. A figure without them cannot be compared with another
machine's, nor with the same VM in a faster spell."""

import pathlib
import time

BANDWIDTH_BYTES = 1 << 29  # at least, and 4x the last-level cache (480 MiB on some Xeons): a read streams from memory
READ_BYTES = 1 << 30       # the read bandwidth reads at most this much of the files (a figure, not a load)
READ_BUFFER = 16 << 20
CACHE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "48K", "491520K"


def describe() -> str:
    """CPU model, architecture, cores, widest SIMD, the kernel variant in use, memory."""
    import platform

    import psutil

    from kernels import native

    flags, model = set(), ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX")) if flag in flags]
    return (f"{model or platform.processor() or platform.machine()} ({platform.machine()}), {psutil.cpu_count()} "
            f"cores, {'+'.join([simd, *extras])}, kernels {native.VARIANT}, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB")


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs lists for CPU 0 (0 where it lists none)."""
    largest = 0
    for size in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        if text[:-1].isdigit() and text[-1] in CACHE_UNITS:
            largest = max(largest, int(text[:-1]) * CACHE_UNITS[text[-1]])
    return largest


class MemoryProbe:
    """Measures the memory bandwidth again and again on one buffer far larger than the caches
    (faulted in once): a benchmark whose VM swings between minutes measures it beside each run."""

    def __init__(self):
        import torch

        self.size = max(BANDWIDTH_BYTES, 4 * last_level_cache_bytes())
        self.buffer = torch.ones(self.size // 4)
        self.buffer.sum()  # faults the pages in

    def measure(self, repeats: int = 5) -> float:
        """Bytes/s that summing the buffer reads, best of `repeats`."""
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self.buffer.sum()
            best = min(best, time.perf_counter() - start)
        return self.size / best


def read_bandwidth(files: list[pathlib.Path], repeats: int = 3) -> tuple[float, int]:
    """(bytes/s of a sequential read of `files` from the page cache into one reused buffer, on one
    thread, best of `repeats` after a pass that brings them into the cache; the bytes read: at most
    READ_BYTES, from the first file on)."""
    buffer = memoryview(bytearray(READ_BUFFER))

    def one_pass() -> int:
        total = 0
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while total < READ_BYTES and (n := f.readinto(buffer[:min(READ_BUFFER, READ_BYTES - total)])):
                    total += n
        return total

    total, best = one_pass(), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return (total / best if total else 0.0), total


def measure(checkpoint: pathlib.Path | None = None, probe: MemoryProbe | None = None) -> dict:
    """The machine and its bandwidths now (the memory's with `probe` where the caller has one); the
    read, of `checkpoint`'s safetensors files (where given)."""
    probe = probe or MemoryProbe()
    out = {"machine": describe(), "memory_bandwidth_bytes_per_s": probe.measure(), "memory_bytes_summed": probe.size}
    files = sorted(pathlib.Path(checkpoint).glob("*.safetensors")) if checkpoint else []
    if files:
        out["read_bandwidth_bytes_per_s"], out["read_bytes"] = read_bandwidth(files)
    return out


def line(measured: dict) -> str:
    """One line for a benchmark's table: the machine, then its bandwidths."""
    text = (f"machine: {measured['machine']}; memory {measured['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
            f"(sum of {measured['memory_bytes_summed'] >> 20} MiB)")
    if "read_bandwidth_bytes_per_s" in measured:
        text += (f", page-cached read {measured['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (one thread, "
                 f"{measured['read_bytes'] / 2**20:.0f} MiB of the checkpoint)")
    return text
