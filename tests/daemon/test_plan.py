import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from preload_cli.models import tiny_model
from preload_daemon.arch import KINDS, ArchSpec, classify
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import CheckpointError, PlanError
from preload_daemon.execute import execute
from preload_daemon.plan import ALIGNMENT, LoadSpec, build_plan


def materialise(path, **spec):
    ckpt = Checkpoint(path)
    plan = build_plan(ckpt, LoadSpec(path=str(path), **spec))
    dest = torch.empty(plan.total_bytes, dtype=torch.uint8)
    execute(plan, ckpt, dest)
    views = {e.name: dest[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in plan.entries}
    return plan, views


def test_tp1_plan_keeps_every_tensor_aligned_and_exact(tiny_llama):
    plan, views = materialise(tiny_llama)
    ref = load_file(str(tiny_llama / "model.safetensors"))
    assert set(views) == set(ref)
    assert all(e.offset % ALIGNMENT == 0 for e in plan.entries)
    for name, tensor in ref.items():
        assert torch.equal(views[name], tensor), name


def test_dtype_conversion_matches_torch(tiny_llama):
    _, views = materialise(tiny_llama, dtype="bfloat16")
    ref = load_file(str(tiny_llama / "model.safetensors"))
    for name, tensor in ref.items():
        assert views[name].dtype == torch.bfloat16
        assert torch.equal(views[name], tensor.to(torch.bfloat16))


def test_padding_is_zeroed_so_cold_bytes_are_deterministic(tiny_llama):
    """Two executions into garbage-filled memory give identical bytes, padding included."""
    ckpt = Checkpoint(tiny_llama)
    plan = build_plan(ckpt, LoadSpec(path=str(tiny_llama)))
    a = torch.full((plan.total_bytes,), 0xAB, dtype=torch.uint8)
    b = torch.full((plan.total_bytes,), 0x11, dtype=torch.uint8)
    execute(plan, ckpt, a)
    execute(plan, ckpt, b)
    assert torch.equal(a, b)


def test_tp_shards_converted_to_another_dtype_reassemble_the_converted_tensors(tiny_llama):
    """Shards converted on the way (float32 stored, bfloat16 asked): a shard along K (o, down) is
    read as its piece of each row into the scratch buffer, then converted."""
    ref = load_file(str(tiny_llama / "model.safetensors"))
    shards = [materialise(tiny_llama, tp_size=2, tp_rank=r, dtype="bfloat16")[1] for r in range(2)]
    for name, dim in (("model.layers.0.self_attn.o_proj.weight", 1), ("model.layers.1.mlp.down_proj.weight", 1),
                      ("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.1.mlp.up_proj.weight", 0)):
        assert shards[0][name].dtype == torch.bfloat16
        assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), ref[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_reassemble_the_full_tensors(tiny_llama, tp):
    """Column shards concatenate along rows, row shards along columns; with 2 kv heads and TP 4,
    each kv head is replicated on two ranks."""
    ref = load_file(str(tiny_llama / "model.safetensors"))
    shards = [materialise(tiny_llama, tp_size=tp, tp_rank=r)[1] for r in range(tp)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([s[q] for s in shards]), ref[q])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[o] for s in shards], dim=1), ref[o])
    assert torch.equal(torch.cat([s["model.embed_tokens.weight"] for s in shards]), ref["model.embed_tokens.weight"])
    assert all(torch.equal(s["model.norm.weight"], ref["model.norm.weight"]) for s in shards)
    k = "model.layers.1.self_attn.k_proj.weight"
    if tp == 2:
        assert torch.equal(torch.cat([s[k] for s in shards]), ref[k])
    else:
        head_dim = 16
        for r, s in enumerate(shards):
            head = r * 2 // tp
            assert torch.equal(s[k], ref[k][head * head_dim:(head + 1) * head_dim])


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "fp9"}, "unknown quantization scheme 'fp9'"),
    ({"dtype": "float64"}, "unknown dtype 'float64'"),
    ({"tp_size": 2, "tp_rank": 2}, "tp_rank 2 is not in"),
    ({"component": "encoder"}, "unknown component"),
])
def test_bad_specs(kwargs, message):
    with pytest.raises(PlanError, match=message):
        LoadSpec(path="/x", **kwargs)


def test_shapes_that_contradict_config(tmp_path, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_llama / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj.weight. has shape \[64, 128\] but config.json implies \[64, 96\]"):
        build_plan(Checkpoint(tmp_path, allow_external=True), LoadSpec(path=str(tmp_path)))


def test_unknown_architecture(tmp_path, tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_llama / "model.safetensors")
    with pytest.raises(PlanError, match="'GPT2LMHeadModel' is not supported"):
        build_plan(Checkpoint(tmp_path, allow_external=True), LoadSpec(path=str(tmp_path)))


def test_mtp_layers_form_the_draft_component(tmp_path, tiny_llama):
    """Layers past num_hidden_layers (DeepSeek-V3 MTP naming) go to the draft, not the main model."""
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.layers.2.enorm.weight"] = torch.ones(64)
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.randn(64, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tiny_llama / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    main = build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))
    draft = build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path), component="draft"))
    assert not any(e.name.startswith("model.layers.2.") for e in main.entries)
    assert {e.name for e in draft.entries} == {n for n in tensors if n.startswith("model.layers.2.")}
    with pytest.raises(PlanError, match="no MTP layers"):
        build_plan(Checkpoint(tiny_llama), LoadSpec(path=str(tiny_llama), component="draft"))


def test_roles():
    """The architecture spec's one table gives each tensor kind its role, parallel style and layer."""
    def role(name):
        kind, layer = classify(name)
        return kind.role, kind.style, layer
    assert role("model.layers.3.self_attn.k_proj.weight") == ("linear", "kv", 3)
    assert role("model.layers.3.mlp.down_proj.weight") == ("linear", "row", 3)
    assert role("lm_head.weight") == ("lm_head", "vocab", None)
    assert role("model.layers.3.self_attn.q_norm.weight") == ("norm", "replicated", 3)
    assert role("model.layers.3.self_attn.q_proj.bias") == ("bias", "column", 3)
    assert classify("model.layers.3.mlp.experts.0.w1.weight") is None


def test_classify_matches_each_kinds_template_as_a_pattern():
    """classify's lookups name the same kind and layer as matching every kind's template, {layer}
    as 1-9 decimal digits, against the whole name: on every template with good and bad layer
    numbers (non-ASCII digits, 10 digits, none, a sign) and with a character added around it."""
    def reference(name):
        for kind in KINDS:
            pattern = re.escape(kind.template).replace(re.escape("{layer}"), r"(\d{1,9})")
            match = re.fullmatch(pattern, name)
            if match:
                return kind, int(match.group(1)) if match.groups() else None
        return None

    names = ["", "model.layers.", "model.layers.3", "model.layers.3.", "lm_head.weight\n"]
    for kind in KINDS:
        for layer in ("0", "7", "01", "123456789", "1234567890", "\u0663", "", "x", "-1", "3.4", "{layer}"):
            name = kind.template.replace("{layer}", layer)
            names += [name, name + "x", "x" + name, name + ".weight", name + "\n"]
    found = [(name, classify(name)) for name in names]
    assert found == [(name, reference(name)) for name in names]
    assert sum(kind is not None for _, kind in found) > 4 * len(KINDS)  # most templates matched


def test_unknown_and_missing_tensors_are_refused(tmp_path, tiny_llama):
    """A tensor of no known kind, or a checkpoint lacking one the config needs, fails before loading."""
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    save_file({**tensors, "model.layers.0.mlp.router.weight": torch.ones(4, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor.s. of no kind LlamaForCausalLM has, e.g. "
                                              "model.layers.0.mlp.router.weight"):
        build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="1 tensor.s. that config.json needs are missing, e.g. "
                                              "model.layers.1.mlp.up_proj.weight"):
        build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))


def test_layers_past_the_configs_are_refused_not_dropped(tmp_path, tiny_llama):
    """config.json with fewer layers than the weights: the layers past them were dropped unseen (as
    if they were MTP layers, with none in the config), and the model ran on the first ones alone."""
    config = json.loads((tiny_llama / "config.json").read_text())
    shutil.copy(tiny_llama / "model.safetensors", tmp_path / "model.safetensors")
    assert config["num_hidden_layers"] == 2
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"9 tensor.s. of layers past config.json's num_hidden_layers \(1\) and "
                                              r"num_nextn_predict_layers \(0\), e.g. model.layers.1.input_layernorm."
                                              r"weight.* does not belong to these weights"):
        build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))
    # the last layer taken for an MTP layer (the draft's), which has none of an MTP layer's own tensors
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="1 tensor.s. that config.json needs are missing, e.g. "
                                              "model.layers.1.eh_proj.weight"):
        build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))


def test_rotary_inv_freq_is_skipped_only_under_its_own_name(tmp_path, tiny_llama):
    """Some exporters store `rotary_emb.inv_freq`, which is derived at run time: skipped alone or after a
    dot; a name that only ends in those letters is a tensor of no kind."""
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    stored = {"rotary_emb.inv_freq": torch.ones(8), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file({**tensors, **stored}, str(tmp_path / "model.safetensors"))
    plan = build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))
    assert sorted(e.name for e in plan.entries) == sorted(tensors)
    for name in ("model.layers.0.self_attn.xrotary_emb.inv_freq", "rotary_emb.inv_freq\n", "rotary_emb.inv_freqs"):
        save_file({**tensors, name: torch.ones(8)}, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match="1 tensor.s. of no kind LlamaForCausalLM has"):
            build_plan(Checkpoint(tmp_path), LoadSpec(path=str(tmp_path)))


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": "64"}, "hidden_size must be an integer >= 1, got '64'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"rope_scaling": [1]}, "rope_scaling must be an object"),
    ({"eos_token_id": "x"}, "eos_token_id must be an integer or a list"),
])
def test_bad_config_fields_name_the_field(tiny_llama, config, message):
    base = json.loads((tiny_llama / "config.json").read_text())
    with pytest.raises(CheckpointError, match=message):
        ArchSpec.from_config({**base, **config})


@pytest.mark.parametrize("tp, scheme, message", [
    (3, "none", "num_attention_heads=4 is not divisible by 3.*TP sizes that fit: 1, 2, 4"),
    (2, "fp8_block", "q_proj rows per rank = 32, not a multiple of fp8_block's 128-row block.*TP sizes that fit: 1$"),
    (4, "mxfp4", "o_proj columns per rank = 16, not a multiple of mxfp4's 32-element block.*TP sizes that fit: 1, 2$"),
])
def test_tp_sizes_that_do_not_fit_name_the_numbers(tiny_llama, tp, scheme, message):
    """A TP size that does not divide the heads, or cuts a quantization block, fails before loading
    and says which sizes would work."""
    with pytest.raises(PlanError, match=message):
        build_plan(Checkpoint(tiny_llama), LoadSpec(path=str(tiny_llama), tp_size=tp, quantization=scheme))


def test_qwen2_bias_and_qwen3_norm_shapes(checkpoints):
    """Architectures with q/k/v biases (Qwen2) and q/k norms (Qwen3) pass the shape checks."""
    for arch in ("qwen2", "qwen3"):
        path = tiny_model(arch, checkpoints / f"plan-{arch}")
        plan, views = materialise(path, tp_size=2, tp_rank=1)
        assert plan.architecture.lower().startswith(arch)
        assert views["model.norm.weight"].shape == (64,)


def test_threads_and_chunks_change_nothing_and_a_rank_reads_its_half(tiny_llama, monkeypatch):
    """Reads split into chunks across threads fill the same bytes, and hash them in order, as one
    thread reading whole tensors; a TP=2 rank reads about half of the checkpoint's bytes."""
    import xxhash

    import preload_daemon.execute as execute_module

    def run(threads, **spec):
        ckpt = Checkpoint(tiny_llama, read_ahead=True)
        plan = build_plan(ckpt, LoadSpec(path=str(tiny_llama), **spec))
        dest = torch.full((plan.total_bytes,), 0x5A, dtype=torch.uint8)
        hasher, seen = xxhash.xxh3_128(), []
        execute(plan, ckpt, dest, on_tensor=seen.append, hasher=hasher, threads=threads)
        assert ckpt.read_ahead._stopped.is_set()  # the load's own reads took over
        assert [e.name for e in seen] == [e.name for e in plan.entries]
        padding = torch.ones(plan.total_bytes, dtype=torch.bool)
        for e in plan.entries:
            padding[e.offset:e.offset + e.nbytes] = False
        assert not dest[padding].any()  # every byte no tensor holds is zeroed, however dest started
        return dest, hasher.hexdigest(), ckpt

    whole = run(1)
    assert whole[1] == xxhash.xxh3_128(whole[0].numpy()).hexdigest()  # every byte, padding too, once
    monkeypatch.setattr(execute_module, "READ_CHUNK", 4096)
    monkeypatch.setattr(execute_module, "BATCH_BYTES", 4096)
    monkeypatch.setattr(execute_module, "HASH_SPAN", 3000)  # hashed in many spans, not at the end alone
    chunked = run(4)
    assert torch.equal(whole[0], chunked[0]) and whole[1] == chunked[1]
    for spec in ({"dtype": "bfloat16"}, {"quantization": "fp8_per_channel"}, {"tp_size": 2, "tp_rank": 1}):
        assert torch.equal(run(1, **spec)[0], run(3, **spec)[0]), spec
    # NVFP4's parts of one weight leave padding between them here (the k and v projections' 128
    # bytes of block scales before their global scale), zeroed as the padding after a tensor is.
    nvfp4 = build_plan(Checkpoint(tiny_llama), LoadSpec(path=str(tiny_llama), quantization="nvfp4"))
    assert any(a.source == b.source and a.offset + a.nbytes < b.offset for a, b in zip(nvfp4.entries, nvfp4.entries[1:]))
    run(2, quantization="nvfp4")

    read = []  # bytes each read system call returned (list.append is atomic: the reads run on 2 threads)
    real_preadv = os.preadv

    def counted(fd, views, offset):
        done = real_preadv(fd, views, offset)
        read.append(done)
        return done
    monkeypatch.setattr(os, "preadv", counted)
    for rank in range(2):
        read.clear()
        _, _, ckpt = run(2, tp_size=2, tp_rank=rank)
        norms = sum(t.nbytes for n, t in ckpt.tensors.items() if n.endswith("norm.weight"))  # replicated
        assert sum(read) == (ckpt.nbytes - norms) // 2 + norms, rank
