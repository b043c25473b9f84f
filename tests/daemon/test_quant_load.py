"""Quantizing while loading: slab sizes, warm == cold bytes and tokens, pre-quantized checkpoints."""

import json
import threading

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.quant import SCHEMES, QuantizedWeight, narrow, quantize, scheme as scheme_of
from preload_cli.models import synthetic_checkpoint, tiny_model
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError, PlanError
from preload_daemon.plan import LoadSpec, build_plan
from tests.conftest import run_python
from worker.loader import LoadRequest, load_ipc_cache, load_safetensors, read_cold


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Projections dominate (small vocabulary), so slab ratios show the schemes' own ratios."""
    return tiny_model("llama", tmp_path_factory.mktemp("wide") / "wide", dtype=torch.bfloat16, hidden_size=256,
                      intermediate_size=512, vocab_size=64, num_attention_heads=4, num_key_value_heads=2)


def linear_bytes(plan) -> int:
    return sum(e.nbytes for e in plan.entries if e.role == "linear")


def test_slab_sizes_per_scheme(daemon, wide_model):
    infos = {s: daemon.client.load(LoadSpec(path=str(wide_model), quantization=s)) for s in ("none", *SCHEMES)}
    plans = {s: build_plan(Checkpoint(wide_model), LoadSpec(path=str(wide_model), quantization=s)) for s in infos}
    assert {s: i.slab_bytes for s, i in infos.items()} == {s: p.total_bytes for s, p in plans.items()}
    bf16 = infos["none"].slab_bytes
    assert infos["fp8_per_tensor"].slab_bytes == pytest.approx(bf16 / 2, rel=0.05)  # + embeddings, norms
    base = linear_bytes(plans["none"])
    assert linear_bytes(plans["fp8_per_tensor"]) == pytest.approx(base / 2, rel=0.01)
    assert linear_bytes(plans["mxfp4"]) == pytest.approx(base * (1 / 4 + 1 / 64), rel=0.01)  # + e8m0 per 32
    assert linear_bytes(plans["nvfp4"]) == pytest.approx(base * (1 / 4 + 1 / 32), rel=0.01)  # + e4m3 per 16
    for scheme in ("mxfp4", "nvfp4"):
        assert infos[scheme].slab_bytes < 0.32 * bf16
    assert {i.version for i in infos.values()} == {1}, "each scheme is a variant of the one version"
    assert len({i.key.content_digest for i in infos.values()}) == len(infos)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_warm_slab_equals_cold_bytes(daemon, wide_model, scheme):
    spec = LoadSpec(path=str(wide_model), quantization=scheme)
    daemon.client.load(spec)
    request = LoadRequest(spec=spec, runtime_dir=daemon.config.runtime_dir, fallback=False)
    warm, cold = load_ipc_cache(request), load_safetensors(request)
    assert warm.attached.key.quantization == scheme
    for name, tensor in cold.tensors.items():
        w = warm.tensors[name]
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(w.view(torch.uint8), tensor.view(torch.uint8)), name
        else:
            assert w.scheme == tensor.scheme and w.shape == tensor.shape
            for a, b in ((w.weight, tensor.weight), (w.scale, tensor.scale), (w.global_scale, tensor.global_scale)):
                if a is not None:
                    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """Every scheme fits TP=2: each shard of every projection is whole 128x128 blocks."""
    return tiny_model("llama", tmp_path_factory.mktemp("tp") / "tp", dtype=torch.bfloat16, hidden_size=512,
                      intermediate_size=1024, vocab_size=64, num_attention_heads=8, num_key_value_heads=4)


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_tp_rank_quantizes_its_shard_into_tp1s_parts_and_reads_only_what_its_scales_need(tp_model, scheme):
    """Each rank of TP=2 holds TP=1's quantized parts narrowed to its shard, bit for bit, and reads
    only its shard where the shard's scales lie within it: with block scales (fp8_block, MX) about
    half the checkpoint; with one scale per row (int8, FP8 per channel) its rows of the
    column-parallel weights (q, k, v, gate, up), but the row-parallel ones (o, down) whole; with a
    scale of the whole weight (FP8 per tensor, NVFP4's global scale) every weight whole."""
    checkpoint = Checkpoint(tp_model)
    _, whole, _ = read_cold(LoadSpec(path=str(tp_model), quantization=scheme))
    full = build_plan(checkpoint, LoadSpec(path=str(tp_model), quantization=scheme))
    tp1: dict = {}
    for e in full.entries:
        if e.quantize:
            tp1.setdefault(e.source, {})[e.part] = whole[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
    column_parallel = sum(info.nbytes for name, info in checkpoint.tensors.items()
                          if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                            "up_proj.weight")))
    for rank in range(2):
        before = _bytes_read()
        plan, slab, _ = read_cold(LoadSpec(path=str(tp_model), quantization=scheme, tp_size=2, tp_rank=rank))
        read = _bytes_read() - before
        shards = {e.source: e.shard for e in plan.entries if e.quantize}
        assert len(shards) == 14  # 7 projections in each of 2 layers
        for source, shard in shards.items():
            parts = tp1[source]
            q = QuantizedWeight(scheme, parts["weight"], parts["weight_scale"], parts.get("weight_global_scale"),
                                tuple(checkpoint.tensors[source].shape))
            expected = narrow(q, shard.dim, shard.start, shard.length)
            expected = {"weight": expected.weight, "weight_scale": expected.scale,
                        "weight_global_scale": expected.global_scale}
            for e in plan.entries:
                if e.source == source:
                    got = slab[e.offset:e.offset + e.nbytes]
                    assert torch.equal(got, expected[e.part].reshape(-1).view(torch.uint8)), (rank, source, e.part)
        found = scheme_of(scheme)
        if found.weight_scale:
            assert read >= 0.95 * checkpoint.nbytes, (read, checkpoint.nbytes)
        elif found.row_scale:
            assert checkpoint.nbytes - 0.6 * column_parallel < read < checkpoint.nbytes - 0.4 * column_parallel, \
                (read, checkpoint.nbytes, column_parallel)
        else:
            assert read < 0.6 * checkpoint.nbytes, (read, checkpoint.nbytes)


@pytest.mark.parametrize("scheme", ["int8", "fp8_block", "nvfp4"])
def test_sources_read_ahead_on_the_pool_load_the_same_bytes(tp_model, scheme, monkeypatch):
    """A load that reads the next quantized source on its pool while it quantizes one (every source
    here: the size threshold set to 0) writes the same bytes as one that reads each in its turn, at
    TP=1 and on each TP=2 rank (row shards, column shards, weights read whole for the scales that span
    them); it did read ahead. A read ahead that fails fails the load with its error, and the pool
    winds down."""
    from preload_daemon import execute, reader, sources
    readers = []
    real_read = reader.Reader._read

    def spy(self, name, shard, index):
        readers.append(threading.current_thread().name)
        return real_read(self, name, shard, index)

    monkeypatch.setattr(reader.Reader, "_read", spy)
    monkeypatch.setattr(sources, "RUN_BYTES", 0)  # each source on its own (runs of small ones: below)
    for tp_size, tp_rank in ((1, 0), (2, 0), (2, 1)):
        spec = LoadSpec(path=str(tp_model), quantization=scheme, tp_size=tp_size, tp_rank=tp_rank)
        monkeypatch.setattr(execute, "READ_AHEAD_BYTES", 1 << 62)
        readers.clear()
        _, in_turn, _ = read_cold(spec)
        assert readers and not any(name.startswith("load") for name in readers)
        monkeypatch.setattr(execute, "READ_AHEAD_BYTES", 0)
        readers.clear()
        _, ahead, _ = read_cold(spec)
        assert sum(name.startswith("load") for name in readers) == 13, readers  # all 14 sources but the first
        assert torch.equal(in_turn, ahead), (tp_size, tp_rank)

    real_read_into = Checkpoint.read_into

    def failing(self, name, out, skip=0):
        if name.endswith("layers.1.mlp.up_proj.weight") and threading.current_thread().name.startswith("load"):
            raise CheckpointError(f"{name}: the disk went away")
        return real_read_into(self, name, out, skip)

    monkeypatch.setattr(Checkpoint, "read_into", failing)
    before = threading.active_count()
    with pytest.raises(CheckpointError, match="up_proj.weight: the disk went away"):
        read_cold(LoadSpec(path=str(tp_model), quantization=scheme))
    assert threading.active_count() == before


@pytest.fixture
def runs(monkeypatch):
    """(weights, result, [(N, K) of each weight]) of each native call that quantizes a run of sources."""
    from kernels import quant
    if not quant.many_native():
        pytest.skip("no native kernels here: each source is quantized on its own")
    calls = []
    real = quant.quantize_many

    def spy(source, dtype, weights, dest, name):
        sizes = [(weights[k + 1], weights[k + 2]) for k in range(0, len(weights), 8)]
        calls.append((len(weights) // 8, real(source, dtype, weights, dest, name), sizes))
        return calls[-1][1]

    monkeypatch.setattr(quant, "quantize_many", spy)
    return calls


def _alone(spec: LoadSpec, monkeypatch) -> torch.Tensor:
    """The cold load's bytes with every quantized source quantized on its own."""
    from preload_daemon import sources
    with monkeypatch.context() as patch:
        patch.setattr(sources, "RUN_BYTES", 0)
        return read_cold(spec)[1]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_runs_of_small_sources_load_the_bytes_each_alone_loads(tp_model, scheme, runs, monkeypatch):
    """Small quantized sources in a row, with the norms between them, are read together and quantized
    in one native call (kernels.quant.quantize_many), and write the bytes that quantizing each on its
    own writes: at TP=1, and on each TP=2 rank, whose row shards are runs too (but for the schemes
    whose scale spans the whole weight, which each rank reads whole: on their own)."""
    for tp_size, tp_rank in ((1, 0), (2, 0), (2, 1)):
        spec = LoadSpec(path=str(tp_model), quantization=scheme, tp_size=tp_size, tp_rank=tp_rank)
        runs.clear()
        together = read_cold(spec)[1]
        assert max(runs, default=(0,))[0] >= 2 or (tp_size == 2 and scheme_of(scheme).weight_scale), runs
        runs.clear()
        assert torch.equal(together, _alone(spec, monkeypatch)) and not runs, (tp_size, tp_rank)


@pytest.mark.parametrize("scheme", ["int8", "mxfp4", "nvfp4"])
def test_sources_too_large_to_share_a_run_but_not_read_ahead_are_runs_too(tp_model, scheme, runs, monkeypatch):
    """A source of RUN_BYTES or more that is not read ahead (under READ_AHEAD_BYTES; here each MLP
    projection, 1 MiB) is quantized on the pool in a run, alone or ending one, not on the loading
    thread while the pool idles; it writes the bytes that quantizing it alone writes."""
    from preload_daemon import sources
    spec = LoadSpec(path=str(tp_model), quantization=scheme)
    runs.clear()
    together = read_cold(spec)[1]
    large = [(n, k) for _, _, sizes in runs for n, k in sizes if n * k * 2 >= sources.RUN_BYTES]
    assert sorted(large) == [(512, 1024)] * 2 + [(1024, 512)] * 4, runs  # down, then gate and up, two layers
    assert torch.equal(together, _alone(spec, monkeypatch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_runs_read_float32_and_float16_and_refuse_what_each_alone_refuses(tmp_path, dtype, runs, monkeypatch):
    """Runs quantize float32 and float16 checkpoints as each weight alone does; a weight in a run with
    a value that is not finite fails the load with the error it fails with alone, naming it."""
    model = tiny_model("llama", tmp_path / "m", dtype=dtype, hidden_size=256, intermediate_size=512,
                       vocab_size=64, num_attention_heads=4, num_key_value_heads=2)
    for scheme in ("int8", "fp8_block", "mxfp4", "nvfp4"):
        spec = LoadSpec(path=str(model), quantization=scheme)
        runs.clear()
        together = read_cold(spec)[1]
        assert max(runs, default=(0,))[0] >= 2
        assert torch.equal(together, _alone(spec, monkeypatch)), scheme
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"][5, 7] = float("nan")
    tensors["model.layers.1.self_attn.k_proj.weight"][6, 1] = float("-inf")
    save_file(tensors, str(model / "model.safetensors"))
    for scheme in ("int8", "fp8_per_tensor", "nvfp4"):
        spec = LoadSpec(path=str(model), quantization=scheme)
        runs.clear()
        with pytest.raises(CheckpointError) as together:
            read_cold(spec)
        assert any(bad >= 0 for _, bad, _ in runs)  # found by a run
        with pytest.raises(CheckpointError) as alone:
            _alone(spec, monkeypatch)
        assert str(together.value) == str(alone.value)
        assert "cannot quantize 'model.layers.1.self_attn.k_proj.weight'" in str(together.value)
        assert "weight has 2 non-finite value(s)" in str(together.value)


def test_a_float64_weight_past_float32s_range_fails_the_load_naming_it(tmp_path):
    """A weight stored as float64 is quantized in float32: one with a value past its range fails the
    load, naming the weight and why (FP8 per tensor had loaded it as NaNs), on the cold path and
    a TP rank holding it; within the range it loads."""
    model = tiny_model("llama", tmp_path / "m", dtype=torch.bfloat16, hidden_size=64, intermediate_size=128,
                       vocab_size=64, num_attention_heads=2, num_key_value_heads=2)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].double()
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = 1e300
    save_file(tensors, str(model / "model.safetensors"))
    for scheme in ("fp8_per_tensor", "int8", "nvfp4"):
        for tp_size in (1, 2):  # (rank 0 holds the row)
            spec = LoadSpec(path=str(model), quantization=scheme, tp_size=tp_size, tp_rank=0)
            with pytest.raises(CheckpointError, match=rf"cannot quantize 'model.layers.0.mlp.up_proj.weight' to "
                               rf"{scheme}: weight has values beyond float32's range \(largest magnitude 1e\+300\)"):
                read_cold(spec)
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = 1e30
    save_file(tensors, str(model / "model.safetensors"))
    plan, slab, _ = read_cold(LoadSpec(path=str(model), quantization="fp8_per_tensor"))
    scale = next(e for e in plan.entries if e.name == "model.layers.0.mlp.up_proj.weight_scale")
    assert slab[scale.offset:scale.offset + 4].view(torch.float32).item() == pytest.approx(1e30 / 448, rel=1e-6)


def test_runs_keep_the_next_large_source_read_ahead_and_the_first_error_first(tp_model, tmp_path, runs,
                                                                             monkeypatch):
    """A large source right after a run is read ahead on the pool while the run is written, as after a
    source quantized alone (here every gate, up and down projection of 1 MiB: the threshold set to
    that); and where a weight in a run and a later one quantized alone both hold a NaN, the load names
    the first, as quantizing each alone does."""
    from preload_daemon import execute, reader
    pool_reads = []
    real_read = reader.Reader._read

    def spy(self, name, shard, index):
        if threading.current_thread().name.startswith("load"):
            pool_reads.append(name)
        return real_read(self, name, shard, index)

    monkeypatch.setattr(reader.Reader, "_read", spy)
    monkeypatch.setattr(execute, "READ_AHEAD_BYTES", 1 << 20)
    spec = LoadSpec(path=str(tp_model), quantization="int8")
    together = read_cold(spec)[1]
    assert max(runs, default=(0,))[0] >= 2
    expected = {f"model.layers.{layer}.mlp.{name}.weight" for layer in (0, 1) for name in ("gate_proj", "up_proj",
                                                                                            "down_proj")}
    # (in plan order, layer 1's down projection right after a run; layer 0's is the first source)
    assert sorted(pool_reads) == sorted(expected - {"model.layers.0.mlp.down_proj.weight"})
    assert torch.equal(together, _alone(spec, monkeypatch))

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tp_model / "config.json").read_text())
    tensors = load_file(str(tp_model / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"][1, 2] = float("nan")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"))
    spec = LoadSpec(path=str(broken), quantization="int8")
    for _ in range(3):
        with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.k_proj.weight'") as together:
            read_cold(spec)
        with pytest.raises(CheckpointError) as alone:
            _alone(spec, monkeypatch)
        assert str(together.value) == str(alone.value)


def make_prequantized(source, target):
    """An FP8 block checkpoint in the DeepSeek-V3 layout: e4m3 weights plus weight_scale_inv."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        if name.endswith("proj.weight"):
            q = quantize(t, "fp8_block")
            tensors[name], tensors[name + "_scale_inv"] = q.weight, q.scale
        else:
            tensors[name] = t
    save_file(tensors, str(target / "model.safetensors"))
    return tensors


def test_prequantized_fp8_block_checkpoint_loads_as_is(wide_model, tmp_path, daemon):
    stored = make_prequantized(wide_model, tmp_path / "fp8")
    spec = LoadSpec(path=str(tmp_path / "fp8"), quantization="fp8_block")
    weights = load_safetensors(LoadRequest(spec=spec))
    q = weights.tensors["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(q.weight.view(torch.uint8), stored["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    assert torch.equal(q.scale, stored["model.layers.0.mlp.down_proj.weight_scale_inv"])
    with pytest.raises(PlanError, match="pre-quantized fp8_block weights .* load it with --quantization fp8_block"):
        build_plan(Checkpoint(tmp_path / "fp8"), LoadSpec(path=str(tmp_path / "fp8"), quantization="int8"))
    with pytest.raises(PlanError, match="not a multiple of fp8_block.s 128-row block.*TP sizes that fit: 1"):
        build_plan(Checkpoint(tmp_path / "fp8"), LoadSpec(path=str(tmp_path / "fp8"), quantization="fp8_block",
                                                          tp_size=4, tp_rank=1))
    info = daemon.client.load(spec)  # and through the daemon, next to anything else it holds
    assert info.key.quantization == "fp8_block"


@pytest.mark.parametrize(("bad", "shown"), [(float("nan"), "nan"), (1e300, "inf"), (-0.5, "-0.5")])
def test_prequantized_block_scales_that_are_not_finite_or_negative_fail_the_load(wide_model, tmp_path, daemon, bad,
                                                                                 shown):
    """A pre-quantized checkpoint's block scale that is NaN, infinite (here a float64 one past float32's
    range; its block all NaN) or negative (its block's signs flipped) fails the load, cold and in the
    daemon, naming the tensor; the daemon keeps what it holds. Zero is a scale (an all-zero block)."""
    stored = make_prequantized(wide_model, tmp_path / "fp8")
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    good = daemon.client.load(LoadSpec(path=str(tmp_path / "fp8"), quantization="fp8_block")).version
    stored[name] = stored[name].double()
    stored[name][1, 0] = bad
    save_file(stored, str(tmp_path / "fp8" / "model.safetensors"))
    message = rf"'{name}' holds 1 block scale\(s\) that are not finite or are negative \(the first: {shown}\)"
    with pytest.raises(CheckpointError, match=message):
        read_cold(LoadSpec(path=str(tmp_path / "fp8"), quantization="fp8_block"))
    with pytest.raises(CheckpointError, match=message):
        daemon.client.load(LoadSpec(path=str(tmp_path / "fp8"), quantization="fp8_block", dtype="float32"))
    assert daemon.client.attach("fp8").version == good
    stored[name][1, 0] = 0.0
    save_file(stored, str(tmp_path / "fp8" / "model.safetensors"))
    read_cold(LoadSpec(path=str(tmp_path / "fp8"), quantization="fp8_block"))


def test_bad_quantization_requests_leave_the_daemon_serving(daemon, wide_model, tmp_path):
    daemon.client.load(LoadSpec(path=str(wide_model)))
    from protos import preload_pb2 as pb
    import grpc
    channel = grpc.insecure_channel(f"unix:{daemon.config.socket_path}")
    stream = channel.unary_stream("/preload.v1.WeightCache/LoadModel",
                                  request_serializer=pb.LoadModelRequest.SerializeToString,
                                  response_deserializer=pb.LoadProgress.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(stream(pb.LoadModelRequest(spec=pb.LoadSpec(path=str(wide_model), quantization="fp5"))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown quantization scheme 'fp5'" in \
        err.value.details()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((wide_model / "config.json").read_text())
    tensors = load_file(str(wide_model / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][3, 3] = float("inf")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="cannot quantize 'model.layers.0.mlp.up_proj.weight'.*non-finite"):
        daemon.client.load(LoadSpec(path=str(broken), quantization="int8"))
    assert daemon.client.attach("wide").version == 1
    channel.close()


def test_quantizing_load_needs_no_unquantized_copy(daemon, tmp_path):
    """Peak memory of a quantizing load is bounded by one layer's temporaries, far below one
    unquantized copy of the model."""
    ckpt = synthetic_checkpoint(tmp_path / "synth", 0.4, hidden=512)
    checkpoint = Checkpoint(ckpt)
    checkpoint_bytes = checkpoint.nbytes
    largest_fp32 = max(4 * t.nbytes // t.dtype.itemsize for n, t in checkpoint.tensors.items() if "proj" in n)
    proc = psutil.Process(daemon.proc.pid)
    before = proc.memory_info().rss  # VmHWM below is an RSS peak too
    info = daemon.client.load(LoadSpec(path=str(ckpt), quantization="mxfp4"))
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        peak = int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
    # The slab itself is resident (and counted); the rest of the peak is the float32 temporaries of
    # quantizing one projection (about ten of them), here ~40 MB against a 400 MB checkpoint.
    excess = peak - before - info.slab_bytes
    assert excess < 16 * largest_fp32 < 0.2 * checkpoint_bytes, (excess, largest_fp32, checkpoint_bytes)


def test_a_quantizing_load_faults_in_little_more_than_its_destination(default_model):
    """Each weight's float32 temporaries come from memory the heap kept from the weight before
    (buffers.heap_kept): the default model's int8 cold load, in a fresh process, faults in about its
    destination's pages. glibc left alone returned them after each weight, and the load faulted in
    5.0-5.3 times as many pages."""
    ratios = run_python(f"""
import mmap, resource
from preload_daemon.plan import LoadSpec
from worker.loader import read_cold
spec = LoadSpec(path={str(default_model)!r}, quantization="int8")
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    plan, slab, _ = read_cold(spec)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (plan.total_bytes / mmap.PAGESIZE))
    del slab
""")
    assert all(float(r) < 1.5 for r in ratios.split()), ratios


def test_the_heap_hands_back_what_it_kept_when_the_last_quantizing_load_ends():
    """heap_kept: freed temporaries stay (a layer's worth of them, in the default model's shapes, is
    not faulted in again at the next layer), and the memory is given back (malloc_trim) when the
    last user leaves; a nested user keeps it until then. The control holds glibc at its initial
    thresholds, where every temporary is mapped afresh; left to adjust them, glibc faults thousands
    of pages a layer in some processes and none in others."""
    out = run_python("""
import ctypes, resource, torch
from preload_daemon import buffers
SIZES = (576 * 576, 192 * 576, 192 * 576, 576 * 576, 1536 * 576, 1536 * 576, 576 * 1536)
def rss():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024
def layer():  # a quantization's float32 temporaries for each weight of a layer, freed before the next
    for n in SIZES:
        a = torch.ones(n); b = a * 2; c = b + a
        q = c.to(torch.int8)
    return int(q[0])
def faults():  # the median over 11 layers (the heap's layout may shift once in a while)
    layer()
    counts = []
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        layer()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(counts)[5]
libc = ctypes.CDLL(None)
assert libc.mallopt(-3, 128 << 10) == 1 and libc.mallopt(-1, 128 << 10) == 1  # M_MMAP_ and M_TRIM_THRESHOLD
plain = faults()
with buffers.heap_kept():
    with buffers.heap_kept():
        kept = faults()
    nested = rss()
after = rss()
print(plain, kept, (nested - after) / 2**20)
""")
    plain, kept, handed_back = map(float, out.split())
    assert plain > 1000 and kept < plain / 10, (plain, kept)
    assert handed_back >= 4, handed_back  # at least a 3.5 MB temporary's worth
