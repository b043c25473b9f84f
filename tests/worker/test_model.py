"""Our model against Hugging Face transformers on the same checkpoint."""

import json

import pytest
import torch
import transformers

from kernels import native
from kernels.attention import PREFILL_VARIANTS
from preload_cli.models import tiny_model
from preload_daemon.buffers import SlabViews
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.execute import execute
from preload_daemon.plan import LoadSpec, build_plan
from worker.model import CausalLM, runs

ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Scaled so that the prompts' positions reach the dimensions each scaling changes.
ROPE_LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
ROPE_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
ROPE_YARN_MSCALE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False}
# The ramp over dimensions 1 to 7 of 16 (an original context of 256), where truncate and an
# explicit attention_factor change the result.
ROPE_YARN_RAMP = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256}
ROPE_YARN_RAMP_EXACT = {**ROPE_YARN_RAMP, "truncate": False, "attention_factor": 1.25}
CASES = {
    "llama-gqa": ("llama", {}),
    "llama-tied-llama3-rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": ROPE_LLAMA3}),
    "llama-linear-rope": ("llama", {"rope_parameters": ROPE_LINEAR}),
    "qwen2-yarn-rope": ("qwen2", {"rope_parameters": ROPE_YARN}),
    "qwen3-yarn-mscale-rope": ("qwen3", {"head_dim": 32, "rope_parameters": ROPE_YARN_MSCALE}),
    "qwen3-yarn-ramp-rope": ("qwen3", {"head_dim": 32, "rope_parameters": ROPE_YARN_RAMP}),
    "qwen3-yarn-ramp-exact-rope": ("qwen3", {"head_dim": 32, "rope_parameters": ROPE_YARN_RAMP_EXACT}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}


def load(path, dtype="auto"):
    ckpt = Checkpoint(path)
    plan = build_plan(ckpt, LoadSpec(path=str(path), dtype=dtype))
    dest = torch.empty(plan.total_bytes, dtype=torch.uint8)
    execute(plan, ckpt, dest)
    views = SlabViews(dest)
    weights = {e.name: views.view(e.offset, e.nbytes, e.dtype, e.shape) for e in plan.entries}
    return CausalLM.from_config(ckpt.config, weights)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(checkpoints, case):
    arch, overrides = CASES[case]
    path = tiny_model(arch, checkpoints / f"ref-{case}", seed=1, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load(path)
    prompt = torch.tensor([[5, 17, 99, 3, 200, 41, 7, 8, 150, 2, 33]])

    cache = model.new_cache(1, 64)
    ours = model.forward(prompt, torch.arange(prompt.shape[1])[None], cache, torch.tensor([0]), all_logits=True)
    with torch.no_grad():
        theirs = ref(prompt).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())

    # Greedy decoding through the cache, one token at a time, against transformers.generate.
    tokens, ids = [], prompt
    cache = model.new_cache(1, 64)
    logits = model.forward(ids, torch.arange(ids.shape[1])[None], cache, torch.tensor([0]))
    for step in range(12):
        tokens.append(int(logits.argmax(-1)))
        pos = prompt.shape[1] + step
        logits = model.forward(torch.tensor([[tokens[-1]]]), torch.tensor([[pos]]), cache, torch.tensor([0]))
    expected = ref.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == expected[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("fields", [
    # A config saved by transformers 5 (plain rope_parameters) with a model card's rope_scaling added:
    # transformers takes rope_scaling, and rope_theta from the top level.
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "rope_theta": 20000.0,
     "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    # Phi-3 keeps original_max_position_embeddings at the top level, which wins over the dict's.
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}, "original_max_position_embeddings": 16},
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0}, "original_max_position_embeddings": 16},
    # A DeepSeek-style yarn whose mscale_all_dim (and here beta_fast) of 0 stand for absent.
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0, "beta_fast": 0}},
], ids=["rope-scaling-over-parameters", "top-level-original-yarn", "top-level-original-llama3", "yarn-zeros-absent"])
def test_rope_fields_are_read_where_transformers_reads_them(checkpoints, fields):
    path = tiny_model("llama", checkpoints / f"rope-{len(list(checkpoints.iterdir()))}", seed=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor([list(range(3, 60))])
    model = load(path)
    ours = model.forward(prompt, torch.arange(prompt.shape[1])[None], model.new_cache(1, 64), torch.tensor([0]),
                         all_logits=True)
    with torch.no_grad():
        theirs = ref(prompt).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())


def test_batched_decode_equals_one_by_one(tiny_llama):
    """Rows of different lengths decoded together give the same logits as each alone."""
    model = load(tiny_llama)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8], [100, 101, 102]]
    cache = model.new_cache(3, 32)
    last = []
    for slot, p in enumerate(prompts):
        logits = model.forward(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([slot]))
        last.append(int(logits.argmax(-1)))
    batched = model.forward(torch.tensor(last)[:, None], torch.tensor([[len(p)] for p in prompts]), cache,
                            torch.tensor([0, 1, 2]))
    for slot, p in enumerate(prompts):
        alone = model.new_cache(1, 32)
        model.forward(torch.tensor([p]), torch.arange(len(p))[None], alone, torch.tensor([0]))
        single = model.forward(torch.tensor([[last[slot]]]), torch.tensor([[len(p)]]), alone, torch.tensor([0]))
        torch.testing.assert_close(batched[slot], single[0], rtol=1e-5, atol=1e-5)


def test_missing_weights_are_refused(tiny_llama):
    ckpt = Checkpoint(tiny_llama)
    weights = {n: ckpt.read(n) for n in ckpt.tensors if "layers.1.mlp.up_proj" not in n}
    with pytest.raises(Exception, match="lack 1 tensor.*layers.1.mlp.up_proj.weight.*uninitialised"):
        CausalLM.from_config(ckpt.config, weights)


@pytest.mark.parametrize("variant", ["torch", native.available()[0]])
def test_one_sequence_is_bit_for_bit_transformers_in_bfloat16(checkpoints, variant):
    """With the pure torch kernels (PRELOAD_KERNELS=torch) prefill and every decode step run
    torch's own products, as transformers does: the logits are equal bit for bit, not merely close.
    The native variants' decode steps (the fused layer: their GEMV, norm and attention) sum in
    another order, so there they are close, with the same greedy tokens (the engine's warm = cold
    either way: both run the same kernels)."""
    path = tiny_model("llama", checkpoints / "ref-bf16", dtype=torch.bfloat16, seed=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = load(path)
    prompt = torch.tensor([[5, 17, 99, 3, 200, 41, 7]])
    out = ref.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, prompt.shape[1]:].tolist()
    cache = model.new_cache(2, 64)
    with native.using(variant):
        logits = [model.forward(prompt, torch.arange(prompt.shape[1])[None], cache, torch.tensor([1]))]
        for i, token in enumerate(tokens[:-1]):
            logits.append(model.forward(torch.tensor([[token]]), torch.tensor([[prompt.shape[1] + i]]), cache,
                                        torch.tensor([1])))
    for ours, theirs in zip(logits, out.logits):
        if variant == "torch":
            assert torch.equal(ours, theirs.float())
        else:
            torch.testing.assert_close(ours, theirs.float(), rtol=2e-2, atol=2e-2 * theirs.abs().max().item())
    assert [int(step.argmax()) for step in logits] == tokens


def test_rows_at_scattered_slots_with_several_tokens_equal_one_by_one(tiny_llama):
    """Rows whose slots are not consecutive (their cache is gathered) and that add several tokens at
    once (speculative verification, a draft's catch-up), and equal-length prompts prefilled together,
    give what each row gives alone."""
    model = load(tiny_llama)
    prompts = {2: [1, 2, 3, 4, 5, 6], 0: [9, 8], 3: [100, 101, 102]}
    cache = model.new_cache(4, 32)
    for slot, p in prompts.items():
        model.forward(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([slot]))
    new = {2: [7, 11], 0: [12, 13], 3: [14, 15]}
    batched = model.forward(torch.tensor(list(new.values())),
                            torch.tensor([[len(p), len(p) + 1] for p in prompts.values()]), cache,
                            torch.tensor(list(prompts)), all_logits=True)
    together = model.forward(torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.arange(3).expand(2, 3),
                             model.new_cache(2, 8), torch.tensor([0, 1]))
    for row, (slot, p) in enumerate(prompts.items()):
        alone = model.new_cache(1, 32)
        model.forward(torch.tensor([p]), torch.arange(len(p))[None], alone, torch.tensor([0]))
        single = model.forward(torch.tensor([new[slot]]), torch.tensor([[len(p), len(p) + 1]]), alone,
                               torch.tensor([0]), all_logits=True)
        torch.testing.assert_close(batched[row], single[0], rtol=1e-5, atol=1e-5)
    for row, p in enumerate([[3, 4, 5], [6, 7, 8]]):
        single = model.forward(torch.tensor([p]), torch.arange(3)[None], model.new_cache(1, 8), torch.tensor([0]))
        torch.testing.assert_close(together[row], single[0], rtol=1e-5, atol=1e-5)


def test_prompts_of_one_length_prefilled_together_attend_causally_over_their_own_keys(checkpoints):
    """Prompts of one length prefilled in one forward (as the engine groups them) take the causal
    route over their new keys, with no mask and no gathered cache (SDPA's causal kernel, or the native
    prefill attention where the variant has it), and give each row's logits and cached keys and
    values as the row alone does, up to bfloat16 rounding; rows that do not all start at position 0
    keep the masked path."""
    model = load(tiny_model("llama", checkpoints / "together-bf16", dtype=torch.bfloat16, seed=4, head_dim=32))
    prompts = torch.tensor([[5, 6, 7, 8, 9], [40, 41, 42, 43, 44], [9, 7, 5, 3, 1]])
    cache = model.new_cache(3, 16)
    positions, slots = torch.arange(5).expand(3, 5), torch.tensor([2, 0, 1])
    step = model._step(positions, slots, cache)
    assert step.causal and step.hidden is None and not step.keys
    together = model.forward(prompts, positions, cache, slots)
    for row, slot in enumerate(slots.tolist()):
        alone = model.new_cache(1, 16)
        single = model.forward(prompts[row:row + 1], torch.arange(5)[None], alone, torch.tensor([0]))[0]
        torch.testing.assert_close(together[row], single, rtol=2e-2, atol=2e-2 * single.abs().max().item())
        assert int(together[row].argmax()) == int(single.argmax())
        torch.testing.assert_close(cache.all[:, slot, :, :, :5].float(), alone.all[:, 0, :, :, :5].float(),
                                   rtol=2e-2, atol=2e-2)
    later = model._step(torch.tensor([[0, 1], [3, 4]]), torch.tensor([0, 1]), cache)
    assert not later.causal and later.hidden is not None


@pytest.mark.parametrize("variant", native.available())
def test_a_bfloat16_prefill_stays_close_to_transformers_on_every_variant(checkpoints, variant, monkeypatch):
    """A bfloat16 prompt's prefill with heads of 32, in cache slot 2 of 3: on the variants of
    PREFILL_VARIANTS (avx512bf16) its attention is the native prefill attention (its calls counted),
    elsewhere SDPA's (amx's too: faster there); every position's logits are close to transformers',
    and the greedy token after the prompt is its."""
    path = tiny_model("llama", checkpoints / "prefill-bf16", dtype=torch.bfloat16, seed=5, head_dim=32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = load(path)
    prompt = torch.randint(3, 250, (1, 45), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = ref(prompt).logits.float()
    calls = []
    with native.using(variant), monkeypatch.context() as patch:  # undone before `using` restores
        op = native.prefill_attention
        if op is not None:
            patch.setattr(native, "prefill_attention", lambda *a: calls.append(a[0].shape) or op(*a))
        ours = model.forward(prompt, torch.arange(45)[None], model.new_cache(3, 64), torch.tensor([2]), all_logits=True)
    assert len(calls) == (len(model.layers) if variant in PREFILL_VARIANTS else 0)
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max().item())
    assert int(ours[0, -1].argmax()) == int(theirs[0, -1].argmax())


def test_batched_bfloat16_decode_stays_close_to_each_row_alone(checkpoints):
    """Several bfloat16 rows decode together (the fused layer's GEMV over all the rows, or, without
    native kernels, float32-widened weight tiles: kernels/dense.py): equal to each row alone up to
    bfloat16 rounding, and the same greedy tokens."""
    model = load(tiny_model("llama", checkpoints / "batched-bf16", dtype=torch.bfloat16, seed=3))
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8], [100, 101, 102]]
    cache = model.new_cache(3, 32)
    last = [int(model.forward(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([s])).argmax())
            for s, p in enumerate(prompts)]
    batched = model.forward(torch.tensor(last)[:, None], torch.tensor([[len(p)] for p in prompts]), cache,
                            torch.tensor([0, 1, 2]))
    for slot, p in enumerate(prompts):
        alone = model.new_cache(1, 32)
        model.forward(torch.tensor([p]), torch.arange(len(p))[None], alone, torch.tensor([0]))
        single = model.forward(torch.tensor([[last[slot]]]), torch.tensor([[len(p)]]), alone, torch.tensor([0]))[0]
        torch.testing.assert_close(batched[slot], single, rtol=2e-2, atol=2e-2 * single.abs().max().item())
        assert int(batched[slot].argmax()) == int(single.argmax())


def test_weights_that_lie_back_to_back_are_multiplied_as_one_view(tiny_llama):
    """gate and up (and q, k, v where the slab keeps them adjacent) become views over the loaded
    memory, never copies."""
    model = load(tiny_llama)
    layer = model.layers[0]
    assert layer.gate_up is not None and layer.gate_up.data_ptr() == layer.gate.data_ptr()
    assert layer.gate_up.untyped_storage().data_ptr() == layer.gate.untyped_storage().data_ptr()
    assert torch.equal(layer.gate_up, torch.cat((layer.gate, layer.up)))
    # The slab keeps checkpoint (name) order: k_proj, o_proj, q_proj, v_proj. q and v lie back to
    # back and become one product over a view starting at q; k stays alone.
    projections = (layer.q, layer.k, layer.v)
    assert sorted(g[2] for g in layer.qkv) == [(0, 2), (1,)]
    for weight, _, members in layer.qkv:
        assert weight.data_ptr() == projections[members[0]].data_ptr()
        assert torch.equal(weight, torch.cat([projections[m] for m in members]))


def test_projections_with_and_without_a_bias_are_not_grouped():
    """Back-to-back weights whose bias presence differs stay separate products (a grouped bias
    would drop or misplace one)."""
    flat = torch.randn(3 * 8 * 4)
    q, k, v = flat.view(3, 8, 4).unbind(0)
    bias = torch.randn(8)
    groups = runs((q, k, v), (None, bias, bias))
    assert [g[2] for g in groups] == [(0,), (1, 2)]
    assert groups[0][1] is None and torch.equal(groups[1][1], torch.cat((bias, bias)))


@pytest.mark.parametrize("variant", native.available())
def test_float16_model_decodes_on_every_kernel_variant(checkpoints, variant):
    """float16 has no native decode path (norm, attention, GEMV take float32 and bfloat16): it
    falls back to torch's, with the greedy tokens of transformers."""
    path = tiny_model("llama", checkpoints / "ref-fp16", dtype=torch.float16, seed=3)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    model = load(path)
    assert model.dtype == torch.float16
    prompt = torch.tensor([[5, 17, 99, 3]])
    expected = ref.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    cache, tokens = model.new_cache(2, 32), []
    with native.using(variant):
        logits = model.forward(prompt, torch.arange(4)[None], cache, torch.tensor([1]))
        for step in range(6):
            tokens.append(int(logits.argmax(-1)))
            logits = model.forward(torch.tensor([[tokens[-1]]]), torch.tensor([[4 + step]]), cache, torch.tensor([1]))
    assert tokens == expected[0, 4:].tolist()
