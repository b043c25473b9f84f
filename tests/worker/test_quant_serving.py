"""Quantized models served by engine workers."""

import torch

from preload_cli.models import tiny_model
from preload_daemon.plan import LoadSpec
from tests.worker.test_server import complete


def test_fp8_engine_served_warm_gives_the_cold_tokens(daemon, checkpoints, start_engine):
    model = tiny_model("llama", checkpoints / "serve-fp8", dtype=torch.bfloat16, hidden_size=256,
                       intermediate_size=512, vocab_size=300)
    daemon.client.load(LoadSpec(path=str(model)))
    daemon.client.load(LoadSpec(path=str(model), quantization="fp8_per_tensor"))
    warm = start_engine(model, "ipc_cache", "--quantization", "fp8_per_tensor", "--no-fallback")
    cold = start_engine(model, "safetensors", "--quantization", "fp8_per_tensor")
    assert warm.ready["load_format"] == "ipc_cache"
    assert complete(warm, max_tokens=16)["choices"] == complete(cold, max_tokens=16)["choices"]
    # Both schemes are variants of version 1; each engine leases the one it asked for.
    plain = start_engine(model, "ipc_cache", "--no-fallback")
    assert plain.ready["load_format"] == "ipc_cache" and plain.ready["weights_version"] == 1
    leases = {m.key.quantization: len(m.leases) for m in daemon.client.list_models()}
    assert leases == {"none": 1, "fp8_per_tensor": 1}
