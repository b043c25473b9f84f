"""Builds the optional native CPU kernels (kernels/csrc) into kernels/_native/libpreload_kernels.so on
any x86-64 machine with g++: the torch ops (qgemv.cpp, decode.cpp, layer.cpp and quantize.cpp, plain x86-64) and
the SIMD kernels (qgemv_kernels.cpp) four times, for AVX2, for AVX-512, for AVX-512 with AVX512-BF16
(and VNNI and VBMI) and for that with AMX, and the quantization's (quantize_kernels.cpp) for AVX2 and
AVX-512, all compiled at once. Compiling AVX-512 or AMX code needs no such CPU; kernels/native.py picks at
run time what this CPU can run. Elsewhere, or without g++, it says so and exits 0: the kernels then run their pure torch paths.
scripts/setup.sh runs this.

A unit compiled for an instruction set may define no weak function (isa_leaks): a template or inline
function that the compiler emits out of line is a weak copy, the linker keeps one copy of each for the
whole library, and the copy it kept could be an AVX-512 one that AVX2 code then calls, faulting on a
CPU without AVX-512. The build fails instead, naming the function.

    python scripts/build_kernels.py [--force]
"""

import argparse
import hashlib
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "kernels" / "csrc"
TARGET = ROOT / "kernels" / "_native" / "libpreload_kernels.so"
# -Wno-*uninitialized: g++ 12 warns about its own AVX-512 intrinsic headers.
COMMON = ["-O3", "-std=c++20", "-fPIC", "-Wall", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]
# object name -> (source, flags of its own)
UNITS = {
    "ops": ("qgemv.cpp", ["-fopenmp"]),  # at::parallel_for is OpenMP, compiled into the caller
    "decode": ("decode.cpp", ["-fopenmp"]),
    "layer": ("layer.cpp", ["-fopenmp"]),
    "quantize": ("quantize.cpp", ["-fopenmp"]),
    "avx2": ("qgemv_kernels.cpp", ["-mavx2", "-mfma", "-mf16c"]),
    "avx512": ("qgemv_kernels.cpp", ["-DPRELOAD_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]),
    "avx512bf16": ("qgemv_kernels.cpp", ["-DPRELOAD_AVX512", "-DPRELOAD_BF16DOT", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                         "-mfma", "-mf16c", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"]),
    "amx": ("qgemv_kernels.cpp", ["-DPRELOAD_AVX512", "-DPRELOAD_BF16DOT", "-DPRELOAD_AMX", "-mavx512f", "-mavx512bw",
                                  "-mavx512vl", "-mfma", "-mf16c", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi",
                                  "-mamx-tile", "-mamx-bf16", "-mamx-int8"]),
    # The quantization's loops (quantize_kernels.cpp): no FP traps, so that they vectorize.
    "quantize_avx2": ("quantize_kernels.cpp", ["-fno-trapping-math", "-mavx2", "-mfma", "-mf16c"]),
    "quantize_avx512": ("quantize_kernels.cpp", ["-fno-trapping-math", "-DPRELOAD_AVX512", "-mavx512f", "-mavx512bw",
                                                 "-mavx512vl", "-mfma", "-mf16c"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild even if the sources have not changed")
    args = parser.parse_args()
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        print("build_kernels: not an x86-64 machine or no g++; the quantized linear layer uses its pure torch path",
              file=sys.stderr)
        return 0
    import torch
    from torch.utils import cpp_extension

    sources = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + repr(UNITS).encode()
                            + torch.__version__.encode()).hexdigest()
    stamp = TARGET.with_suffix(".sha256")
    if TARGET.exists() and stamp.exists() and stamp.read_text() == digest and not args.force:
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    print(f"build_kernels: compiling {', '.join(UNITS)} (a minute at most, once)", file=sys.stderr)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        objects = {name: pathlib.Path(tmp) / f"{name}.o" for name in UNITS}
        jobs = [subprocess.Popen(["g++", *COMMON, *flags, abi, *includes, "-c", str(CSRC / source),
                                  "-o", str(objects[name])])
                for name, (source, flags) in UNITS.items()]
        if any([job.wait() for job in jobs]):
            print("build_kernels: compilation failed (see above)", file=sys.stderr)
            return 1
        if not units_contained({name: objects[name] for name, (_, flags) in UNITS.items() if _isa_specific(flags)}):
            return 1
        libs = cpp_extension.library_paths()
        subprocess.run(["g++", "-shared", "-fopenmp", *map(str, objects.values()), "-o", str(TARGET),
                        *(f"-L{p}" for p in libs), "-lc10", "-ltorch_cpu", *(f"-Wl,-rpath,{p}" for p in libs)],
                       check=True)
    stamp.write_text(digest)
    print(f"build_kernels: built {TARGET.relative_to(ROOT)} in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0


def _isa_specific(flags: list[str]) -> bool:
    """Whether a unit is compiled for instructions beyond plain x86-64 (-mavx2, -mavx512f, ...)."""
    return any(flag.startswith("-m") for flag in flags)


# nm's letters for weak symbols a unit defines: code (W, w) or an indirect function (i). A weak data
# object (V, v: the exception personality's reference, say) holds no instructions.
_WEAK_CODE = frozenset("Wwi")


def units_contained(objects: typing.Mapping[str, pathlib.Path]) -> bool:
    """Whether no unit compiled for an instruction set defines a weak function (isa_leaks); if one
    does, or nm is missing, says so on stderr."""
    try:
        leaks = isa_leaks(objects)
    except FileNotFoundError:  # g++ links with binutils, which has nm: a broken toolchain
        print("build_kernels: nm is missing; install GNU binutils (it checks the units compiled for an instruction "
              "set)", file=sys.stderr)
        return False
    for leak in leaks:
        print(f"build_kernels: {leak}", file=sys.stderr)
    return not leaks


def isa_leaks(objects: typing.Mapping[str, pathlib.Path]) -> list[str]:
    """One line per weak function that a unit compiled for an instruction set defines (see the module
    doc), naming the unit and the function; empty where there is none."""
    leaks = []
    for name, path in objects.items():
        listing = subprocess.run(["nm", "--defined-only", "--demangle", "--format=posix", str(path)],
                                 capture_output=True, text=True, check=True).stdout
        for line in listing.splitlines():  # "name type value size", the name demangled (spaces and all)
            symbol, kind = line.rsplit(" ", 3)[:2]
            if kind in _WEAK_CODE:
                unit = f"{name}.o (compiled with {' '.join(UNITS[name][1])})" if name in UNITS else path.name
                leaks.append(f"{unit} defines {symbol} as a weak symbol: the linker keeps one copy of it for the whole "
                             "library, and code for another instruction set could call this one. Define it in an "
                             "anonymous namespace (a std:: template: use it in a unit for plain x86-64 instead)")
    return leaks


if __name__ == "__main__":
    sys.exit(main())
