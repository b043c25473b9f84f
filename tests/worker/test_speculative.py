"""Speculative decoding: greedy output identical to plain greedy decoding (MTP with K = 1 and 3, a
separate draft), an identical draft accepted in full, sampled tokens distributed as the main
model's, warm drafts from the daemon and cold ones, and drafts that cannot work refused."""

import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from preload_cli.main import main as preload_main
from preload_cli.models import tiny_model
from preload_daemon.arch import ArchSpec
from preload_daemon.plan import LoadSpec
from tests.conftest import run_preload
from worker.engine import Engine
from worker.requests import SamplingParams
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM
from worker.mtp import MTPDraft
from worker.speculative import Speculator, greedy, probabilities

PROMPTS = [[5, 17, 99, 3, 200, 41], [7, 7, 7], [250, 1, 30, 31, 32, 33, 34, 35, 36]]


@pytest.fixture(scope="module")
def mtp_llama(tmp_path_factory):
    return tiny_model("llama", tmp_path_factory.mktemp("spec") / "mtp-llama", mtp_layers=1, mtp_shared=True)


@pytest.fixture(scope="module")
def models(mtp_llama, tmp_path_factory):
    """(main CausalLM, its MTP draft, a separate smaller draft with the same vocabulary)."""
    main = load_safetensors(LoadRequest(spec=LoadSpec(path=str(mtp_llama))))
    draft = load_safetensors(LoadRequest(spec=LoadSpec(path=str(mtp_llama), component="draft")))
    spec = ArchSpec.from_config(main.config)
    small = tiny_model("llama", tmp_path_factory.mktemp("small") / "small", seed=3, num_hidden_layers=1)
    other = load_safetensors(LoadRequest(spec=LoadSpec(path=str(small))))
    return (CausalLM(spec, main.tensors), MTPDraft(spec, {**main.tensors, **draft.tensors}),
            CausalLM(ArchSpec.from_config(other.config), other.tensors))


def run(model, speculator, prompts, params):
    """Every prompt submitted at once (they decode, and speculate, as one batch): outputs and stats."""
    engine = Engine(model, max_batch=4, max_len=128, speculator=speculator)
    done = threading.Semaphore(0)
    requests = [engine.submit(p, params, lambda t: None, lambda reason: done.release()) for p in prompts]
    engine.start()
    try:
        for _ in prompts:
            assert done.acquire(timeout=120)
        return [r.output for r in requests], engine.speculation()
    finally:
        engine.stop()


def test_greedy_picks_what_torch_argmax_picks():
    """The engine's greedy picks (numpy's argmax) against torch.argmax: ties take the first, a NaN
    wins over any number, a row of -inf its first, on inference tensors, row slices and single
    rows alike."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        logits = torch.randn(6, 49_152, generator=generator)
        logits[0, [7, 300]] = logits[0].max() + 1  # a tie
        logits[1, [11, 5000]] = float("nan")
        logits[2] = float("-inf")
        logits[3, [2, 9]] = float("inf")
        logits[4] = 0.0
    expected = logits.argmax(-1).tolist()
    assert expected[:5] == [7, 11, 0, 2, 0]
    assert greedy(logits) == expected
    assert greedy(logits[1:4]) == expected[1:4]
    assert [greedy(row) for row in logits] == expected and type(greedy(logits[0])) is int


@pytest.mark.parametrize("top_p", [1e-45, 1e-46, 1e-300, 5e-324])
def test_a_top_p_below_float32s_least_keeps_the_top_token(top_p):
    """top_p is compared in float32, where 1e-46 and less are 0: nothing was kept, and the
    distribution was 0 / 0 (a 500 "probability tensor contains either inf, nan or element < 0")."""
    logits = torch.tensor([0.5, 3.0, 1.0, 2.9])
    probs = probabilities(logits, 1.0, top_p)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("kind,k", [("mtp", 1), ("mtp", 3), ("draft", 1), ("draft", 3), ("self", 2)])
def test_greedy_output_is_plain_greedy_output(models, kind, k):
    main, mtp, small = models
    draft = {"mtp": mtp, "draft": small, "self": main}[kind]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected, _ = run(main, None, PROMPTS, params)
    got, stats = run(main, Speculator(draft, k), PROMPTS, params)
    assert got == expected
    assert stats["proposed"] > 0 and 1 <= stats["tokens_per_main_forward"] <= k + 1
    if kind == "self":  # a draft identical to the main model proposes exactly what it would say
        assert stats["acceptance_rate"] == 1.0 and stats["mean_accepted_length"] > k - 0.5


def test_an_identical_draft_is_accepted_in_full_when_sampling(models):
    main, _, _ = models
    _, stats = run(main, Speculator(main, 3), PROMPTS, SamplingParams(max_tokens=20, temperature=0.8, seed=1,
                                                                       ignore_eos=True))
    assert stats["acceptance_rate"] == 1.0


def test_a_draft_with_nan_weights_fails_no_request(models, tmp_path):
    """Sampling from a NaN draft's logits failed every request of the batch, with torch's raw
    message; its proposals are now uniform guesses, which the main model rejects."""
    main, _, _ = models
    small = tiny_model("llama", tmp_path / "nan", seed=3, num_hidden_layers=1)
    loaded = load_safetensors(LoadRequest(spec=LoadSpec(path=str(small))))
    tensors = {name: t.clone() for name, t in loaded.tensors.items()}
    tensors["model.norm.weight"][0] = float("nan")
    broken = CausalLM(ArchSpec.from_config(loaded.config), tensors)
    greedy_params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected, _ = run(main, None, PROMPTS, greedy_params)
    assert run(main, Speculator(broken, 2), PROMPTS, greedy_params)[0] == expected
    sampled, stats = run(main, Speculator(broken, 2), PROMPTS, SamplingParams(max_tokens=12, temperature=0.9, seed=4,
                                                                               ignore_eos=True))
    assert [len(out) for out in sampled] == [12] * len(PROMPTS) and stats["proposed"] > 0


def test_sampled_tokens_follow_the_main_models_distribution(tmp_path):
    """The second generated token's distribution, over 1500 seeded runs with a random (badly
    matching) MTP draft proposing it, against the exact distribution the main model gives it (the
    sum over the first token). Tolerance: total variation 0.06; sampling noise alone is about 0.03
    here, while accepting every proposal (no rejection rule) gives about 0.3."""
    path = tiny_model("llama", tmp_path / "v16", mtp_layers=1, vocab_size=16)
    main = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path))))
    draft = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path), component="draft")))
    spec = ArchSpec.from_config(main.config)
    model = CausalLM(spec, main.tensors)
    mtp = MTPDraft(spec, {**main.tensors, **draft.tensors})
    prompt, temperature = [5, 7, 9], 1.0
    cache = model.new_cache(16, 8)
    with torch.no_grad():
        first = torch.softmax(model.forward(torch.tensor([prompt]), torch.arange(3)[None], cache,
                                            torch.tensor([0])) / temperature, -1)[0]
        ids = torch.tensor([[*prompt, t] for t in range(16)])
        second = torch.softmax(model.forward(ids, torch.arange(4).expand(16, 4), cache, torch.arange(16))
                               / temperature, -1)
    exact = (first[:, None] * second).sum(0)
    engine = Engine(model, max_batch=1, max_len=8, speculator=Speculator(mtp, 2)).start()
    counts = torch.zeros(16)
    n = 1500
    for seed in range(n):
        out = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=temperature, seed=seed,
                                                     ignore_eos=True)).tokens
        counts[out[1]] += 1
    stats = engine.speculation()
    engine.stop()
    assert 0 < stats["acceptance_rate"] < 1, "the test needs a draft that is sometimes rejected"
    tv = 0.5 * (counts / n - exact).abs().sum()
    assert tv < 0.06, f"total variation {tv:.3f} from the main model's distribution"


def test_warm_and_cold_drafts_and_what_ready_says(runtime_dir, mtp_llama, start_daemon):
    prompt = ",".join(map(str, PROMPTS[0]))

    def generate(*flags):
        out = run_preload("generate", mtp_llama, "--prompt-ids", prompt, "--max-tokens", "16", "--name", "m", *flags,
                          runtime_dir=runtime_dir, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    plain = generate("--load-format", "safetensors")
    cold = generate("--load-format", "safetensors", "--speculative", "mtp", "--num-speculative-tokens", "3")
    assert cold["token_ids"] == plain["token_ids"] and cold["draft"]["load_format"] == "safetensors"
    daemon = start_daemon()
    daemon.client.load(LoadSpec(path=str(mtp_llama), name="m"))  # the main component only
    half = generate("--speculative", "mtp")
    assert half["load_format"] == "ipc_cache" and half["draft"]["load_format"] == "safetensors"
    assert "component ('main' here, 'draft' asked)" in half["draft"]["fallback_reason"]
    refused = run_preload("generate", mtp_llama, "--prompt-ids", prompt, "--name", "m", "--speculative", "mtp",
                          "--no-fallback", runtime_dir=runtime_dir, timeout=300)
    assert refused.returncode == 1 and "--no-fallback" in refused.stderr
    daemon.client.load(LoadSpec(path=str(mtp_llama), name="m", component="draft"))
    warm = generate("--speculative", "mtp", "--num-speculative-tokens", "3", "--no-fallback")
    assert warm["token_ids"] == plain["token_ids"]
    assert (warm["load_format"], warm["draft"]["load_format"], warm["draft"]["weights_version"]) == \
        ("ipc_cache", "ipc_cache", 1)
    deadline = time.monotonic() + 15  # the engine has exited: the daemon reaps both of its leases
    while any(m.leases for m in daemon.client.list_models()):
        assert time.monotonic() < deadline, "a lease outlived its engine"
        time.sleep(0.1)


def test_separate_draft_warm_and_refused_drafts(runtime_dir, mtp_llama, tiny_llama, checkpoints, tmp_path,
                                                default_model, capsys):
    # Quantized: the draft is served in the main model's layout, and the engine asks for that one (it
    # asked for an unquantized draft, which `serve` never loads, so it always ran cold).
    served = run_preload("serve", mtp_llama, "--name", "m", "--draft-model", tiny_llama, "--quantization", "int8",
                         "--no-supervise", runtime_dir=runtime_dir)
    assert served.returncode == 0, served.stderr
    try:
        assert "m v1 (draft) on cpu:0" in served.stdout and "tiny-llama v1 (main) on cpu:0" in served.stdout
        out = run_preload("generate", mtp_llama, "--prompt-ids", "5,17,99", "--max-tokens", "12", "--name", "m",
                          "--quantization", "int8", "--speculative", "draft", "--draft-model", tiny_llama,
                          "--num-speculative-tokens", "2", "--no-fallback", runtime_dir=runtime_dir, timeout=300)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        plain = run_preload("generate", mtp_llama, "--prompt-ids", "5,17,99", "--max-tokens", "12",
                            "--quantization", "int8", "--load-format", "safetensors", runtime_dir=runtime_dir,
                            timeout=300)
        assert doc["token_ids"] == json.loads(plain.stdout)["token_ids"]
        assert doc["draft"]["load_format"] == "ipc_cache" and doc["speculation"]["kind"] == "draft"
    finally:
        for d in json.loads(run_preload("status", "--json", runtime_dir=runtime_dir).stdout)["daemons"]:
            os.kill(d["pid"], signal.SIGTERM)
    wide = tiny_model("llama", checkpoints / "vocab-300", vocab_size=300)
    a, b = tmp_path / "a", tmp_path / "b"
    tokenizer = (default_model / "tokenizer.json").read_text()
    for path, text in ((a, tokenizer), (b, tokenizer + "\n")):  # another file: refused, however small the change
        shutil.copytree(tiny_llama, path)
        (path / "tokenizer.json").write_text(text)
    cases = ((tiny_llama, ["--speculative", "draft", "--draft-model", wide], "vocabulary of 300 tokens, the main model 256"),
             (a, ["--speculative", "draft", "--draft-model", b], "another tokenizer.json"),
             (tiny_llama, ["--speculative", "draft"], "go together"),
             (tiny_llama, ["--speculative", "mtp", "--num-speculative-tokens", "0"], "must be in [1, 16]"),
             (tiny_llama, ["--speculative", "mtp"], "no MTP layers"))
    for model, flags, message in cases:  # in this process: each fails before an engine starts
        assert preload_main(["generate", model, "--prompt-ids", "1,2", "--load-format", "safetensors", *flags,
                             "--runtime-dir", runtime_dir]) == 1
        assert message in capsys.readouterr().err, message

def test_engine_reports_speculation_in_ready_and_metrics(runtime_dir, mtp_llama, start_engine):
    import urllib.request
    engine = start_engine(mtp_llama, "safetensors", "--speculative", "draft", "--draft-model", mtp_llama,
                          "--num-speculative-tokens", "2")
    assert engine.ready["draft"]["kind"] == "draft" and engine.ready["speculation"]["num_speculative_tokens"] == 2
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(engine.url + "/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()
    metrics = urllib.request.urlopen(engine.url + "/metrics", timeout=10).read().decode()
    rate = next(line for line in metrics.splitlines() if line.startswith("preload_engine_spec_acceptance_rate"))
    assert float(rate.split()[-1]) == 1.0, "the model as its own draft is always accepted"
    assert "preload_engine_spec_tokens_per_main_forward" in metrics


@pytest.mark.slow
def test_tp2_speculation_warm_and_cold_equals_plain_greedy(runtime_dir, mtp_llama, tiny_llama):
    """Both drafts at TP 2: the followers run the draft's forwards on their shards too."""
    def generate(*flags):
        out = run_preload("generate", mtp_llama, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", "16",
                          *flags, runtime_dir=runtime_dir, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    plain = generate("--load-format", "safetensors")["token_ids"]
    cold = generate("--load-format", "safetensors", "--tp-size", "2", "--speculative", "mtp",
                    "--num-speculative-tokens", "3")
    assert cold["token_ids"] == plain and cold["speculation"]["proposed"] > 0
    served = run_preload("serve", mtp_llama, "--tp-size", "2", "--draft-model", mtp_llama, "--name", "m",
                         "--no-supervise", runtime_dir=runtime_dir)
    assert served.returncode == 0, served.stderr
    try:
        warm = generate("--tp-size", "2", "--name", "m", "--speculative", "mtp", "--no-fallback")
        assert warm["token_ids"] == plain
        assert [r["draft"]["load_format"] for r in warm["ranks"]] == ["ipc_cache", "ipc_cache"]
        same = generate("--tp-size", "2", "--name", "m", "--speculative", "draft", "--draft-model", mtp_llama,
                        "--num-speculative-tokens", "2", "--no-fallback")
        assert same["token_ids"] == plain and same["speculation"]["acceptance_rate"] == 1.0
    finally:
        for d in json.loads(run_preload("status", "--json", runtime_dir=runtime_dir).stdout)["daemons"]:
            os.kill(d["pid"], signal.SIGTERM)
