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
