"""`preload generate`, the one-shot command."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import copy_checkpoint, run_preload


def test_generate_prints_json_with_a_real_answer(default_model, runtime_dir):
    out = run_preload("generate", default_model, "--prompt", "What is the capital of France?", "--chat",
                      "--max-tokens", "16", runtime_dir=runtime_dir)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"] and result["token_ids"]
    assert result["load_format"] == "safetensors" and "DaemonUnavailableError" in result["fallback_reason"]
    timings = result["timings"]
    assert timings["process_start"] < timings["weights_start"] <= timings["weights_done"] <= timings["ready"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_gpu_engine_on_a_host_without_one_is_refused_with_the_reason(tiny_llama, runtime_dir):
    """--devices cuda:0 where torch sees no GPU: one line naming the device, why and what to use,
    before any weights are read (no cold load in host memory instead)."""
    for load_format in ("safetensors", "ipc_cache"):
        out = run_preload("generate", tiny_llama, "--prompt-ids", "1,2,3", "--devices", "cuda:0", "--load-format",
                          load_format, runtime_dir=runtime_dir)
        assert out.returncode == 1, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert "cuda:0: this process has no usable GPU" in last and "use cpu:N devices" in last, out.stderr


def test_weights_that_give_nan_logits_fail_the_start_with_one_line(tiny_llama, runtime_dir, tmp_path):
    """A NaN in a projection makes every logit NaN: the engine's warm-up request fails, and
    `generate` says so in one line, naming the cause (it had ended in a traceback)."""
    tensors = copy_checkpoint(tiny_llama, tmp_path / "nan")
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "nan" / "model.safetensors"))
    out = run_preload("generate", tmp_path / "nan", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--load-format",
                      "safetensors", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("preload generate: the engine's warm-up request failed, so it cannot serve: cannot "
                           "choose the next token: the model's logits hold NaN or infinity: its weights do"), last


def test_ctrl_c_while_generating_stops_the_scheduler_first(tiny_llama, monkeypatch):
    """Ctrl-C left the engine's thread inside native code while the interpreter exited: `terminate
    called without an active exception`, SIGABRT (3 of 4 tries)."""
    import threading

    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.main import run_generate
    from worker.requests import SamplingParams
    calls = []
    real = Engine.generate

    def interrupted(self, prompt, params):
        calls.append(prompt)
        if len(calls) == 1:
            return real(self, prompt, params)  # the warm-up
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    config = EngineConfig(model=tiny_llama, load_format="safetensors")
    with pytest.raises(KeyboardInterrupt):
        run_generate(config, [1, 2, 3], SamplingParams(max_tokens=4))
    assert len(calls) == 2 and not [t for t in threading.enumerate() if t.name == "engine"]


def test_generation_configs_eos_ends_a_turn_too(default_model, runtime_dir, tmp_path):
    """Some checkpoints list an end-of-turn token only in generation_config.json (transformers and
    vLLM stop on it): config.json's eos alone let a chat run on past its turn into made-up ones."""
    model = tmp_path / "model"
    shutil.copytree(default_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))

    def generate():
        out = run_preload("generate", model, "--prompt", "What is the capital of France?", "--chat",
                          "--max-tokens", "48", runtime_dir=runtime_dir)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    answer = generate()
    assert answer["finish_reason"] == "stop" and "Paris" in answer["text"] and 2 not in answer["token_ids"], answer
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ["2"]}))
    out = run_preload("generate", model, "--prompt-ids", "1,2", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "generation_config.json: eos_token_id must be an integer or a list of integers, " \
        "got ['2']; fix generation_config.json or remove it" in out.stderr.strip().splitlines()[-1], out.stderr
    (model / "generation_config.json").unlink()
    answer = generate()  # the chat's turn ends with <|im_end|> (2), which only config.json's eos (0) would stop
    assert answer["finish_reason"] == "length" and 2 in answer["token_ids"], answer
