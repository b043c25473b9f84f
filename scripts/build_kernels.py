"""Builds the optional native CPU kernels (kernels/csrc/*.cpp) into kernels/_native/, for CPUs with
AVX-512. Elsewhere, or without g++, it says so and exits 0: kernels/linear.py then runs its pure
torch path. scripts/setup.sh runs this.

    python scripts/build_kernels.py [--force]
"""

import argparse
import hashlib
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "kernels" / "csrc").glob("*.cpp"))
TARGET = ROOT / "kernels" / "_native" / "libpreload_kernels.so"
FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c", "-mfma"]


def cpu_supported() -> bool:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx512f", "avx512bw", "avx512vl", "f16c", "fma"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if not cpu_supported() or shutil.which("g++") is None:
        print("build_kernels: no AVX-512 CPU or no g++; the quantized linear layer uses its pure torch path",
              file=sys.stderr)
        return 0
    import torch
    from torch.utils import cpp_extension

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + torch.__version__.encode()).hexdigest()
    stamp = TARGET.with_suffix(".sha256")
    if TARGET.exists() and stamp.exists() and stamp.read_text() == digest and not args.force:
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    lib = pathlib.Path(torch.__file__).parent / "lib"
    cmd = ["g++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), *map(str, SOURCES), "-o", str(TARGET),
           f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    print(f"build_kernels: compiling {', '.join(p.name for p in SOURCES)} (about a minute, once)", file=sys.stderr)
    subprocess.run(cmd, check=True)
    stamp.write_text(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
