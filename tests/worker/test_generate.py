"""`preload generate`, the one-shot command."""

import json

from tests.conftest import run_preload


def test_generate_prints_json_with_a_real_answer(default_model, runtime_dir):
    out = run_preload("generate", default_model, "--prompt", "What is the capital of France?", "--chat",
                      "--max-tokens", "16", runtime_dir=runtime_dir)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"] and result["token_ids"]
    assert result["load_format"] == "safetensors" and "DaemonUnavailableError" in result["fallback_reason"]
    timings = result["timings"]
    assert timings["process_start"] < timings["weights_start"] <= timings["weights_done"] <= timings["ready"]
