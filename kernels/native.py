"""The optional native CPU kernels (kernels/csrc, built by scripts/build_kernels.py on x86-64) and
which of their variants runs: "amx" (AVX-512 with Intel's matrix units for the GEMV), "avx512bf16"
(AVX-512 with AVX512-BF16's dot product for the GEMV of bfloat16 activations, and AVX512-VNNI and
AVX512-VBMI: Zen 4 and 5; Cooper Lake, which lacks VBMI, runs "avx512"), "avx512", "avx2", or
"torch" (none: kernels/linear.py's pure torch path). At import the best one this CPU can run is
chosen, unless PRELOAD_KERNELS=amx|avx512bf16|avx512|avx2|torch forces one; `use` switches at run
time (the tests run every variant the CPU can run that way).

`VARIANT` names the variant in use; `qgemv` and `qgemm` are its ops, and `rms_norm`,
`decode_attention`, `prefill_attention`, `quantize` and `quantize_many` (a weight's quantization,
and many small ones', for kernels/quant.py) the library's other ops (the same in every variant;
the attentions and quantizations run the variant's kernels, told per call), or None for "torch";
`variant_index()` is what the fused decoder layer (kernels/decode_layer.py) is told per call."""

import contextlib
import logging
import os

import torch

VARIANTS = ("amx", "avx512bf16", "avx512", "avx2", "torch")  # best first
ENVIRONMENT = "PRELOAD_KERNELS"
_LIBRARY = os.path.join(os.path.dirname(__file__), "_native", "libpreload_kernels.so")


class VariantUnavailableError(RuntimeError):
    """A requested kernel variant cannot run here (not built, or this CPU lacks its instructions)."""


_OPS = ("variants", "rms_norm", "decode_attention", "prefill_attention", "quantize", "quantize_many",
        *(f"{op}_{v}" for op in ("qgemv", "qgemm") for v in VARIANTS[:-1]))
_broken = ""
"""Why the built library cannot be used ("" where it can or is not built)."""


def _load() -> tuple[str, ...]:
    """The native variants this CPU can run, best first; () where the library is not built, or is
    stale or broken (built from older sources or against another torch): then the pure torch path
    runs, with a warning that says how to rebuild."""
    global _broken
    if not os.path.exists(_LIBRARY):
        return ()
    try:
        torch.ops.load_library(_LIBRARY)
        missing = [op for op in _OPS if not hasattr(torch.ops.preload, op)]
        missing += [name for name in ("DecodeLayer", "DecodeStack") if not _has_class(name)]
        if missing:
            raise RuntimeError(f"it lacks the op(s) {', '.join(missing)}")
        return tuple(torch.ops.preload.variants())
    except (OSError, RuntimeError, AttributeError) as e:
        _broken = f"{_LIBRARY} cannot be used ({e}); rebuild it: python scripts/build_kernels.py --force"
        logging.getLogger(__name__).warning("native CPU kernels off: %s", _broken)
        return ()


def _has_class(name: str) -> bool:
    try:
        getattr(torch.classes.preload, name)
    except (AttributeError, RuntimeError):
        return False
    return True


_RUNNABLE = _load()
VARIANT = "torch"
qgemv = qgemm = rms_norm = decode_attention = prefill_attention = quantize = quantize_many = None


def available() -> tuple[str, ...]:
    """The variants this machine can run, best first; "torch" always."""
    return _RUNNABLE + ("torch",)


def why_unavailable(variant: str) -> str:
    """Why `variant` cannot run here ("" where it can)."""
    if variant not in VARIANTS:
        return f"unknown kernel variant {variant!r}; known: {', '.join(VARIANTS)}"
    if variant in available():
        return ""
    if _broken:
        return f"kernel variant {variant!r} cannot run: {_broken}"
    if not os.path.exists(_LIBRARY):
        return f"kernel variant {variant!r} is not built here: run scripts/build_kernels.py"
    return f"this CPU lacks the instructions of kernel variant {variant!r}; it runs: {', '.join(available())}"


def resolve(requested: str | None) -> str:
    """The variant to run for a PRELOAD_KERNELS value: the best available where None or empty."""
    if not requested:
        return available()[0]
    reason = why_unavailable(requested)
    if reason:
        raise VariantUnavailableError(f"{ENVIRONMENT}={requested}: {reason}")
    return requested


def use(variant: str) -> None:
    """Run the native ops of `variant` from now on (quantized and few-row bfloat16 linear layers,
    the norm, decode and prefill attention, quantization), or none of them for "torch"."""
    global VARIANT, qgemv, qgemm, rms_norm, decode_attention, prefill_attention, quantize, quantize_many
    reason = why_unavailable(variant)
    if reason:
        raise VariantUnavailableError(reason)
    VARIANT = variant
    if variant == "torch":
        qgemv = qgemm = rms_norm = decode_attention = prefill_attention = quantize = quantize_many = None
        return
    ops = torch.ops.preload
    qgemv, qgemm = getattr(ops, f"qgemv_{variant}"), getattr(ops, f"qgemm_{variant}")
    rms_norm, decode_attention, prefill_attention = ops.rms_norm, ops.decode_attention, ops.prefill_attention
    quantize, quantize_many = ops.quantize, ops.quantize_many


def variant_index() -> int:
    """The variant in use as the native layer ops take it (0 avx2, 1 avx512, 2 amx, 3 avx512bf16), or -1
    for "torch"."""
    return {"avx2": 0, "avx512": 1, "amx": 2, "avx512bf16": 3}.get(VARIANT, -1)


@contextlib.contextmanager
def using(variant: str):
    """`use(variant)` for the duration of a with block."""
    previous = VARIANT
    use(variant)
    try:
        yield
    finally:
        use(previous)


use(resolve(os.environ.get(ENVIRONMENT)))
if VARIANT == "torch" and not os.environ.get(ENVIRONMENT):
    logging.getLogger(__name__).info("no native CPU kernels here; quantized linear layers run on pure torch "
                                     "(scripts/build_kernels.py builds them)")
