"""Tensor parallelism for real: N rank processes in a gloo group, against TP=1 and transformers."""

import json
import socket
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from preload_cli.models import tiny_model
from preload_daemon.plan import LoadSpec
from tests.conftest import REPO
from tests.worker.tp_probe import NEW_TOKENS, PROMPT, run_case
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM

# name: (architecture, config overrides, quantization, TP sizes). fp8_block needs 128-row shards.
CASES = {
    "llama-gqa": ("llama", {}, "none", (2, 4)),  # 2 kv heads: at TP 4 each is replicated on two ranks
    "llama-tied": ("llama", {"tie_word_embeddings": True}, "none", (2, 4)),
    "qwen2-bias": ("qwen2", {}, "none", (2, 4)),
    "llama-attention-bias": ("llama", {"attention_bias": True}, "none", (2,)),  # o_proj's bias after the all-reduce
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}, "none", (2, 4)),
    "nvfp4": ("llama", {}, "nvfp4", (2, 4)),
    "fp8-block": ("llama", {"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 4}, "fp8_block",
                  (2,)),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def case_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-cases")
    return {name: tiny_model(arch, root / name, seed=3, **overrides)
            for name, (arch, overrides, _, _) in CASES.items()}


def tp1(path, quantization):
    """Our TP=1 model, cold: the reference for quantized cases."""
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path), quantization=quantization)))
    return CausalLM.from_config(weights.config, weights.tensors)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1_and_transformers_warm_and_cold(tp, case_models, start_daemon, runtime_dir, tmp_path):
    """Every case at TP=2 and TP=4, cold and attached to per-rank daemons: fp32 logits within 1e-4
    relative of TP=1 (and of transformers for unquantized cases), identical greedy tokens."""
    cases = {name: (str(case_models[name]), CASES[name][2]) for name in CASES if tp in CASES[name][3]}
    for rank in range(tp):
        start_daemon(f"cpu:{rank}")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.worker.tp_probe", str(r), str(tp), str(port),
                               str(runtime_dir), str(tmp_path), json.dumps(cases)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(tp)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    tokens = json.loads((tmp_path / "tokens.json").read_text())
    for name, (path, quantization) in cases.items():
        expected, expected_tokens = run_case(tp1(path, quantization))
        if quantization == "none":
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with torch.no_grad():
                theirs = hf(torch.tensor([PROMPT])).logits
            torch.testing.assert_close(expected, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
            generated = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
            assert expected_tokens == generated, name
        for how in ("cold", "warm"):
            logits = load_file(str(tmp_path / f"{name}-{how}.safetensors"))["logits"]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item(),
                                       msg=lambda m: f"{name} {how} TP={tp}: {m}")
            assert tokens[f"{name}/{how}"] == expected_tokens, f"{name} {how} TP={tp}"
