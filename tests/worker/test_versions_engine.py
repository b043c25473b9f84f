"""Engines on versions: each version's outputs match transformers on that version's weights, an
engine keeps its version while newer ones are published, --weights-version and rollback pick what
new engines attach to, and --wait-for-daemon waits for a daemon that is still coming up."""

import json
import shutil
import urllib.request

import pytest
import torch

from preload_cli.models import tiny_model
from preload_daemon.plan import LoadSpec
from preload_daemon.versions import publish_tensors, rollback
from tests.conftest import copy_checkpoint, run_preload

PROMPT = [5, 17, 99, 3, 200, 41]
NEW_TOKENS = 10


@pytest.fixture
def base(tiny_llama, default_model, tmp_path):
    """The tiny checkpoint with a tokenizer (the default model's: its ids cover the tiny vocabulary)."""
    path = tmp_path / "base"
    copy_checkpoint(tiny_llama, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, path / name)
    return path


def greedy(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def until_eos(ids: list[int], eos: int = 2) -> list[int]:
    """What `preload generate` returns of `ids`: it stops at the config's eos token, without it."""
    return ids[:ids.index(eos)] if eos in ids else ids


def generate(path, runtime_dir, *flags) -> dict:
    out = run_preload("generate", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", NEW_TOKENS,
                      "--name", "m", "--no-fallback", *flags, runtime_dir=runtime_dir, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def completion_text(engine) -> str:
    body = json.dumps({"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(engine.url + "/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["text"]


@pytest.mark.slow
def test_each_version_serves_its_own_weights(daemon, base, start_engine):
    import transformers
    from worker.tokenizer import Tokenizer
    runtime = daemon.config.runtime_dir
    daemon.client.load(LoadSpec(path=str(base), name="m"))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    first = greedy(trainer)
    on_v1 = start_engine(base, "ipc_cache", "--name", "m", "--no-fallback")
    assert on_v1.ready["weights_version"] == 1 and on_v1.ready["load_format"] == "ipc_cache"

    torch.manual_seed(1)
    with torch.no_grad():  # a "training step"
        for param in trainer.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    second = greedy(trainer)
    assert until_eos(second) != until_eos(first), "the step must change the greedy tokens for this test to mean anything"
    assert publish_tensors("m", trainer.state_dict(), trainer.config.to_dict(), runtime_dir=runtime) == 2

    on_v2 = generate(base, runtime, "--weights-version", "active")
    assert (on_v2["weights_version"], on_v2["token_ids"]) == (2, until_eos(second))
    tokenizer = Tokenizer.load(base)
    assert completion_text(on_v1) == tokenizer.decode(first), "the running engine keeps version 1"
    models = json.load(urllib.request.urlopen(on_v1.url + "/v1/models", timeout=10))
    assert models["data"][0]["weights_version"] == 1
    on_files = generate(base, runtime)  # started on v1's files: v1, never another version of the name
    assert (on_files["weights_version"], on_files["token_ids"]) == (1, until_eos(first))

    rollback("m", 1, runtime)
    back = generate(base, runtime, "--weights-version", "active")
    assert (back["weights_version"], back["token_ids"]) == (1, until_eos(first))
    pinned = generate(base, runtime, "--weights-version", "2")
    assert (pinned["weights_version"], pinned["token_ids"]) == (2, until_eos(second))

    missing = run_preload("generate", base, "--prompt-ids", "1,2", "--name", "m", "--weights-version", "9",
                          runtime_dir=runtime, timeout=300)
    assert missing.returncode == 1 and "m has no version 9" in missing.stderr and "--weights-version 9" in missing.stderr


def test_weights_that_do_not_fit_the_engine_config_are_refused(daemon, base, checkpoints, runtime_dir):
    other = tiny_model("llama", checkpoints / "other-shape", hidden_size=96, num_attention_heads=4,
                       num_key_value_heads=2)
    daemon.client.load(LoadSpec(path=str(base), name="m"))
    out = run_preload("generate", other, "--prompt-ids", "1,2", "--name", "m", "--weights-version", "active",
                      runtime_dir=daemon.config.runtime_dir, timeout=300)
    assert out.returncode == 1 and "does not fit this engine's config.json: hidden_size (64 vs 96)" in out.stderr


def test_bad_weights_version_flags(runtime_dir, base, capsys):
    from preload_cli.main import main
    for flags, message in ((["--weights-version", "two"], "give a version number"),
                           (["--weights-version", "1", "--load-format", "safetensors"], "needs --load-format ipc_cache")):
        assert main(["generate", base, "--prompt-ids", "1,2", *flags, "--runtime-dir", runtime_dir]) == 1
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # refused as it is parsed
        main(["generate", base, "--prompt-ids", "1,2", "--wait-for-daemon", "-1", "--runtime-dir", runtime_dir])
    assert usage.value.code == 2 and "--wait-for-daemon: '-1': seconds must be a finite number" in capsys.readouterr().err


def test_wait_for_daemon_attaches_once_the_daemon_has_loaded(runtime_dir, base, start_engine, start_daemon):
    engine = start_engine(base, "ipc_cache", "--wait-for-daemon", "60", "--no-fallback", wait=False)
    daemon = start_daemon()
    daemon.client.load(LoadSpec(path=str(base)))
    ready = json.loads(engine.proc.stdout.readline())
    assert ready["event"] == "ready" and ready["load_format"] == "ipc_cache" and ready["weights_version"] == 1
