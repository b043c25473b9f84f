"""The fused decoder layer (kernels/decode_layer.py, kernels/csrc/layer.cpp) against the per-op path
it replaces in a decode step: the same logits and the same cache, for every architecture case,
quantization scheme and native variant, one row and several at scattered slots; and its refusals."""

import os
import threading

import pytest
import torch

from kernels import native
from kernels.decode_layer import MATRIX_UNIT_ROWS, MAX_ROWS, fused_layer
from kernels.dense import native_rows, reduced_gemm_is_slow
from kernels.linear import GEMV_MAX_M
from kernels.rope import rope_table
from preload_cli.models import tiny_model
from preload_daemon.plan import LoadSpec
from tests.worker.test_model import CASES
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM

VARIANTS = [v for v in native.available() if v != "torch"]
needs_native = pytest.mark.skipif(not VARIANTS, reason="the native kernels are not built here")
SCHEMES = ["int8", "fp8_per_tensor", "fp8_per_channel", "fp8_block", "mxfp8", "mxfp4", "nvfp4"]
PROMPTS = {2: [1, 2, 3, 4, 5, 6], 0: [9, 8], 3: [100, 101, 102, 7, 7, 7, 7, 7, 7],
           **{slot: [slot, 3 * slot % 256, 40 + slot][:1 + slot % 3] for slot in range(4, 12)}}
SLOTS = 12


def load(path, quantization: str = "none") -> CausalLM:
    """The model as the engine's cold path builds it (the daemon's load plan, quantized weights)."""
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path), quantization=quantization)))
    return CausalLM.from_config(weights.config, weights.tensors)


def quant_checkpoint(checkpoints):
    """The bfloat16 Llama the quantized cases share (built once a session)."""
    path = checkpoints / "fused-quant"
    if not path.exists():
        tiny_model("llama", path, dtype=torch.bfloat16, seed=5)
    return path


def decode(model, slots: list[int], steps: int, fused: bool, prompts: dict = PROMPTS,
           max_len: int = 32) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of `steps` greedy decode steps of the `prompts` at `slots`, batched, and the cache."""
    saved = model.fused
    model.fused = saved if fused else None
    try:
        cache = model.new_cache(SLOTS, max_len)
        tokens = []
        for slot in slots:
            p = prompts[slot]
            logits = model.forward(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([slot]))
            tokens.append(int(logits.argmax()))
        out = []
        for step in range(steps):
            positions = torch.tensor([[len(prompts[s]) + step] for s in slots])
            logits = model.forward(torch.tensor(tokens)[:, None], positions, cache, torch.tensor(slots))
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
        return out, cache.all.clone()
    finally:
        model.fused = saved


def exact(model, rows: int, scheme: str, variant: str) -> bool:
    """Whether the per-op path runs the very kernels the fused layer runs, so that the two must give
    the same bits: bfloat16 activations, and the same GEMV for every product (kernels/dense.py and
    kernels/linear.py's choices at this many rows on this variant)."""
    if model.dtype != torch.bfloat16:
        return False  # float32 activations: torch's silu rounds its exp apart from ours in the last bit
    with native.using(variant):
        if scheme == "none":
            return rows <= max(1, native_rows())
        return rows <= GEMV_MAX_M


def same(fused, ops, bits: bool):
    """The same bits where both paths run the same kernels (`bits`); elsewhere equal up to one
    bfloat16 step, with the same greedy tokens."""
    (fused, fused_cache), (ops, ops_cache) = fused, ops
    for a, b in zip(fused, ops):
        if bits:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    if bits:
        assert torch.equal(fused_cache, ops_cache)
    else:
        torch.testing.assert_close(fused_cache.float(), ops_cache.float(), rtol=1e-2, atol=1e-2)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", ["llama-gqa", "llama-attention-bias", "qwen2", "qwen3"])
def test_decode_steps_equal_the_per_op_path(checkpoints, case, variant):
    arch, overrides = CASES[case]
    model = load(tiny_model(arch, checkpoints / f"fused-{case}", dtype=torch.bfloat16, seed=4, **overrides))
    assert model.fused is not None and len(model.fused) == len(model.layers)
    with native.using(variant):
        for slots in ([2], [2, 0, 3], list(range(SLOTS))[::-1][:9]):  # 9 rows: more than one pass
            fused, ops = decode(model, slots, 5, fused=True), decode(model, slots, 5, fused=False)
            same(fused, ops, exact(model, len(slots), "none", variant))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_steps_over_long_caches_equal_the_per_op_path(checkpoints, variant):
    """Past 256 cached positions a kv head's attention is split into parts that the threads share
    and that merge in a fixed order (kernels/csrc/weights.h's AttendPlan), in the fused layer (which
    hands out a kv head's parts together but for the last kv heads) as in the per-op path: 254
    positions growing past the split, 520 (three parts), one row and three."""
    model = load(tiny_model("llama", checkpoints / "fused-gqa-long", dtype=torch.bfloat16, seed=4,
                            **{**CASES["llama-gqa"][1], "max_position_embeddings": 1024}))
    prompts = {1: [(7 * i) % 250 + 1 for i in range(254)], 2: PROMPTS[2], 5: [(3 * i) % 250 + 1 for i in range(520)]}
    with native.using(variant):
        for slots in ([1], [5], [1, 2, 5]):
            fused = decode(model, slots, 5, fused=True, prompts=prompts, max_len=536)
            ops = decode(model, slots, 5, fused=False, prompts=prompts, max_len=536)
            same(fused, ops, exact(model, len(slots), "none", variant))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_decode_steps_equal_the_per_op_path(checkpoints, scheme, variant):
    model = load(quant_checkpoint(checkpoints), quantization=scheme)
    assert model.fused is not None
    with native.using(variant):
        fused, ops = decode(model, [2, 0, 3], 4, fused=True), decode(model, [2, 0, 3], 4, fused=False)
    same(fused, ops, exact(model, 3, scheme, variant))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scheme", ["none", *SCHEMES])
@pytest.mark.parametrize("inter", [336, 352])
def test_threads_pack_x_by_columns(checkpoints, inter, scheme, variant):
    """Past one row each thread packs a share of x's columns for every row (whole groups of 64, the
    last share to the end: qgemv_kernels.h's pack_share), where the per-op path packs x whole: four
    threads over widths of 3 groups (the first share empty: it still stores int16's row scales),
    5.25 (int16's last 16 elements a row of their own on AVX-512) and 5.5 groups, at 3 and 9 rows
    (the tiles' and int16's layouts on amx)."""
    path = checkpoints / f"fused-wide-{inter}"
    if not path.exists():
        tiny_model("llama", path, dtype=torch.bfloat16, seed=6, hidden_size=192, intermediate_size=inter,
                   num_attention_heads=3, num_key_value_heads=1)
    model = load(path, quantization=scheme)
    assert model.fused is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with native.using(variant):
            for slots in ([2, 0, 3], list(range(SLOTS))[::-1][:9]):
                fused, ops = decode(model, slots, 3, fused=True), decode(model, slots, 3, fused=False)
                same(fused, ops, exact(model, len(slots), scheme, variant))
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_float32_models_and_quantized_float32_ones(checkpoints, tiny_llama):
    """Plain float32 weights have no native element format: such a model decodes op by op; its
    quantized projections do run fused, on float32 activations."""
    assert load(tiny_llama).fused is None
    model = load(tiny_llama, quantization="fp8_per_channel")
    assert model.fused is not None
    same(decode(model, [2, 0], 3, fused=True), decode(model, [2, 0], 3, fused=False), bits=False)


@needs_native
def test_more_rows_than_a_fused_step_takes_run_op_by_op(checkpoints, monkeypatch):
    """Past the fused layers' max_rows sequences the GEMM paths win: the step runs op by op (the fused
    layers are not called); up to it, each step is one call through every layer."""
    model = load(tiny_model("llama", checkpoints / "fused-rows", dtype=torch.bfloat16, seed=8))
    calls = []
    monkeypatch.setattr(model.fused, "_stack", _Counting(model.fused._stack, calls))
    monkeypatch.setattr(type(model.fused), "max_rows", property(lambda self: 2))
    decode(model, [2, 0, 3], 2, fused=True)
    assert calls == []
    decode(model, [2, 0], 2, fused=True)
    assert len(calls) == 2


class _Counting:
    def __init__(self, layer, calls):
        self._inner, self._calls = layer, calls

    def forward(self, *args):
        self._calls.append(1)
        return self._inner.forward(*args)


@needs_native
def test_decode_steps_are_the_same_from_another_thread_with_more_threads_than_cores(checkpoints):
    """The engine decodes on its scheduler thread while other threads have run torch ops of their
    own (OpenMP then gives each its team, and oversubscribes the CPUs): the fused layer's barrier
    (kernels/csrc/barrier.h) still meets every thread of its region, also with more threads than
    this machine has cores, and the steps give the bits the per-op path gives."""
    model = load(tiny_model("llama", checkpoints / "fused-threads", dtype=torch.bfloat16, seed=10))
    expected = decode(model, [2], 6, fused=False)
    torch.randn(1 << 22).add_(1)  # a parallel op on this (the main) thread: a team of its own
    threads, result = torch.get_num_threads(), {}
    try:
        torch.set_num_threads(2 * (os.cpu_count() or 1) + 1)
        worker = threading.Thread(target=lambda: result.update(out=decode(model, [2], 6, fused=True)))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "the fused decode did not finish: a barrier is missing a thread"
    finally:
        torch.set_num_threads(threads)
    same(result["out"], expected, bits=True)


@needs_native
def test_plain_bfloat16_layers_leave_larger_batches_to_matrix_units(checkpoints):
    """Where torch's bfloat16 GEMM runs on matrix units and the fused GEMV does not (avx512 there),
    more than MATRIX_UNIT_ROWS sequences of a plain bfloat16 model run op by op; quantized layers
    (whose GEMM paths dequantize), CPUs without such units, and the amx and avx512bf16 variants
    (whose GEMV runs on bfloat16 units too) keep the fused step up to MAX_ROWS."""
    path = quant_checkpoint(checkpoints)
    plain, quantized = load(path).fused, load(path, quantization="int8").fused
    units = not reduced_gemm_is_slow(torch.device("cpu"))
    for variant in native.available()[:-1]:
        with native.using(variant):
            assert plain.max_rows == (MATRIX_UNIT_ROWS if units and variant in ("avx512", "avx2") else MAX_ROWS)
            assert quantized.max_rows == MAX_ROWS


def test_what_cannot_run_fused_says_why(checkpoints):
    layer = load(tiny_model("llama", checkpoints / "fused-fp16", dtype=torch.float16, seed=6)).layers[0]
    kwargs = dict(projections={n: getattr(layer, n) for n in ("q", "k", "v", "o", "gate", "up", "down")},
                  norms=(layer.input_norm, layer.post_norm, None, None), biases={}, heads=4, kv_heads=2,
                  head_dim=16, eps=1e-5)
    with native.using("torch"):
        assert "no native kernels" in fused_layer(**kwargs)
    if VARIANTS:
        assert "float16" in fused_layer(**kwargs)


@needs_native
def test_bad_calls_are_refused_not_run(checkpoints):
    model = load(tiny_model("llama", checkpoints / "fused-bad", dtype=torch.bfloat16, seed=7))
    fused = model.fused.layers[0]
    cache = model.new_cache(2, 8)
    x = torch.randn(1, 64).bfloat16()
    rope = rope_table(model.inv_freq, 8, torch.bfloat16)[torch.tensor([3])].unsqueeze(1)
    ok = dict(cache=cache.layers[0], slots=torch.tensor([1]), lengths=torch.tensor([4]), rope=rope)
    assert fused(x, **ok).shape == (1, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused(x, **{**ok, "slots": torch.tensor([2])})
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused(x, **{**ok, "lengths": torch.tensor([9])})
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        fused(torch.randn(1, 32).bfloat16(), **ok)
    with pytest.raises(RuntimeError, match="dtype"):
        fused(x.float(), **ok)
    with pytest.raises(RuntimeError, match="rope"):
        fused(x, **{**ok, "rope": rope[:, :, :1]})
    every = {**ok, "cache": cache.all}  # all the layers at once: the whole cache, each layer's part of it
    second = model.fused.layers[1](fused(x, **ok), **{**ok, "cache": cache.layers[1]})
    assert torch.equal(model.fused(x, **every), second)
    with pytest.raises(RuntimeError, match="2 layers"):
        model.fused(x, **{**every, "cache": cache.all[:1]})
    with pytest.raises(RuntimeError, match="outside the cache"):
        model.fused(x, **{**every, "lengths": torch.tensor([9])})


@needs_native
def test_a_layer_of_the_wrong_shape_is_refused_as_it_is_built(checkpoints):
    """Each projection must have its rows (q, k, v; gate, up in order) and a bias the whole q/k/v
    width, whenever it is given: nothing is read past a tensor's end."""
    model = load(tiny_model("llama", checkpoints / "fused-shapes", dtype=torch.bfloat16, seed=9))
    layer = model.layers[0]
    one = torch.ones(())
    built = torch.classes.preload.DecodeLayer(64, 4, 2, 16, 128, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="in order"):
        built.add(0, layer.k.contiguous(), one, None, 0, 0, 3)  # k where q belongs
    with pytest.raises(RuntimeError, match="in order"):
        built.add(3, torch.zeros(128, 128, dtype=torch.bfloat16), one, None, 0, 0, 3)  # down has 64 rows
    with pytest.raises(RuntimeError, match="q/k/v bias"):
        built.biases(torch.zeros(0, dtype=torch.bfloat16), None)  # before any projection, and too short
    with pytest.raises(RuntimeError, match="q/k/v bias"):
        built.biases(torch.zeros(64, dtype=torch.bfloat16), None)
