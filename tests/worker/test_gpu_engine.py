"""Engines on a GPU (marked `gpu`: skipped without one; scripts/gpu_check.sh runs them): the daemon's
slab in device memory, attached through its CUDA IPC handle; warm equals cold equals transformers."""

import json

import pytest
import torch

from preload_daemon.plan import LoadSpec
from tests.conftest import run_preload

pytestmark = pytest.mark.gpu
PROMPT = "The capital of France is"


def generate(model, runtime_dir, *extra) -> dict:
    out = run_preload("generate", model, "--prompt", PROMPT, "--max-tokens", "12", "--devices", "cuda:0", *extra,
                      runtime_dir=runtime_dir, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_warm_equals_cold_equals_transformers_on_a_gpu(default_model, runtime_dir, start_daemon):
    daemon = start_daemon("cuda:0")
    loaded = daemon.client.load(LoadSpec(path=str(default_model)))
    assert loaded.slab_bytes > 0
    warm = generate(default_model, runtime_dir, "--load-format", "ipc_cache", "--no-fallback")
    cold = generate(default_model, runtime_dir, "--load-format", "safetensors")
    assert warm["load_format"] == "ipc_cache" and cold["load_format"] == "safetensors"
    assert warm["token_ids"] == cold["token_ids"]

    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model, torch_dtype=torch.bfloat16).cuda()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.cuda()
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert warm["token_ids"][:6] == expected[:6]  # bf16 GEMMs of two libraries: the first tokens agree


def test_an_engine_maps_the_daemon_slab_on_its_gpu(default_model, runtime_dir, start_daemon):
    """The manifest names the slab's GPU and a 64-byte handle; a second process opens it."""
    daemon = start_daemon("cuda:0")
    daemon.client.load(LoadSpec(path=str(default_model)))
    from preload_daemon.client import DaemonClient
    client = DaemonClient.for_device("cuda:0", runtime_dir)
    attached = client.attach(default_model.name)
    try:
        slab = attached.manifest.slabs[0]
        assert slab.backend == "cuda" and len(slab.handle) == 64 and slab.device_uuid.startswith("GPU-")
        assert all(t.is_cuda for t in attached.tensors.values())
    finally:
        attached.close()


@pytest.mark.parametrize("case", ["llama-gqa", "qwen3"])
def test_tiny_models_decode_on_a_gpu_as_transformers_does(checkpoints, case):
    """The model on a GPU with its KV cache there: a prefill, one sequence's decode steps (their
    writes and the live views SDPA reads), batched steps at scattered slots and a prefill copied to
    another slot, against transformers on the same GPU in float32."""
    import transformers

    from preload_cli.models import tiny_model
    from tests.worker.test_model import CASES
    from worker.loader import LoadRequest, load_safetensors
    from worker.model import CausalLM

    arch, overrides = CASES[case]
    path = tiny_model(arch, checkpoints / f"gpu-{case}", seed=1, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path)), device="cuda:0"))
    model = CausalLM.from_config(weights.config, weights.tensors)
    assert model.device.type == "cuda"
    prompts = {2: [5, 17, 99, 3, 200, 41, 7], 0: [9, 8], 3: [100, 101, 102, 7, 7, 7, 7, 7, 7, 7, 7, 7]}
    expected = {}
    for slot, p in prompts.items():
        ids = torch.tensor([p]).cuda()
        out = ref.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[slot] = out[0, len(p):].tolist()
    cache = model.new_cache(4, 32)
    assert cache.all.is_cuda
    tokens = {}
    for slot, p in prompts.items():
        logits = model.forward(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([slot]))
        with torch.no_grad():
            theirs = ref(torch.tensor([p]).cuda()).logits[:, -1].float().cpu()
        torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
        tokens[slot] = [int(logits.argmax())]
    model.copy_cache(cache, 2, [1], len(prompts[2]))
    prompts[1], expected[1], tokens[1] = prompts[2], expected[2], list(tokens[2])
    slot = 0  # one sequence alone first, then all four together
    logits = model.forward(torch.tensor([[tokens[slot][-1]]]), torch.tensor([[len(prompts[slot])]]), cache,
                           torch.tensor([slot]))
    tokens[slot].append(int(logits.argmax()))
    slots = [3, 1, 0, 2]
    for _ in range(4):
        ids = torch.tensor([[tokens[s][-1]] for s in slots])
        positions = torch.tensor([[len(prompts[s]) + len(tokens[s]) - 1] for s in slots])
        logits = model.forward(ids, positions, cache, torch.tensor(slots))
        for s, row in zip(slots, logits):
            tokens[s].append(int(row.argmax()))
    for s in slots:
        assert tokens[s] == expected[s][:len(tokens[s])], s
