"""The OpenAI API as chat clients and RL rollouts use it, through the official `openai` client,
against real engines warm and cold, at TP 1 and TP 2: chat and completions, streaming or not,
log-probabilities against transformers' log-softmax, n choices, seeds, penalties, strict fields."""

import json
import math
import re
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections import Counter

import psutil
import pytest
import torch

from preload_cli.models import tiny_model
from preload_daemon.config import DaemonConfig
from tests.conftest import run_preload
from tests.worker.conftest import EngineProcess
from tests.worker.test_engine_parallel import stop_daemons
from worker.tokenizer import Tokenizer

openai = pytest.importorskip("openai")
MODES = [("safetensors", 1), ("ipc_cache", 1), ("safetensors", 2), ("ipc_cache", 2)]
PROMPT = [504, 3575, 282, 4649, 314, 17, 256]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_model(checkpoints, default_model):
    """A tiny random Llama (fp32, 4 heads: TP 2 fits) that speaks the default model's tokenizer and
    chat template."""
    path = checkpoints / "tiny-chat"
    if not path.exists():
        tiny_model("llama", path, vocab_size=49152, bos_token_id=1, eos_token_id=2)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (default_model / name).exists():
                shutil.copy(default_model / name, path / name)
    return path


@pytest.fixture(scope="module")
def reference(chat_model):
    """transformers' log-softmax over the same checkpoint: [T, V] for a sequence of token ids."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model, torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return logits

    return logprobs


@pytest.fixture(scope="module", params=MODES, ids=[f"{f}-tp{t}" for f, t in MODES])
def engine(request, chat_model, tmp_path_factory):
    load_format, tp = request.param
    runtime = tmp_path_factory.mktemp("api")
    runtime.chmod(0o700)
    if load_format == "ipc_cache":
        served = run_preload("serve", chat_model, "--tp-size", tp, "--no-supervise", runtime_dir=runtime)
        assert served.returncode == 0, served.stderr
    extra = ("--no-fallback",) if load_format == "ipc_cache" else ()
    process = EngineProcess(chat_model, load_format, runtime, "--tp-size", str(tp), *extra)
    assert process.ready.get("load_format") == load_format, process.ready
    yield process
    process.stop()
    if load_format == "ipc_cache":
        stop_daemons(runtime)
        shutil.rmtree(DaemonConfig(runtime_dir=runtime).shm_dir, ignore_errors=True)


def client(engine) -> "openai.OpenAI":
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def test_logprobs_are_transformers_log_softmax_greedy_sampled_and_echoed(engine, reference, chat_model):
    api = client(engine)
    greedy = api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    echo=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = greedy.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == PROMPT and len(ids) == 6
    logits = reference(PROMPT + ids)
    expected = torch.log_softmax(logits, -1)
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(PROMPT) + 6  # echo: the prompt's first, from the second token on
    for position, token in enumerate((PROMPT + ids)[1:]):
        assert got[position + 1] == pytest.approx(float(expected[position, token]), rel=1e-4, abs=1e-4)
    # the top 3 at each generated position are transformers' top 3
    top = choice.logprobs.top_logprobs[len(PROMPT)]
    values, indices = expected[len(PROMPT) - 1].topk(3)
    assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), rel=1e-4, abs=1e-4)
    tokenizer = Tokenizer.load(chat_model)
    assert set(top) == {tokenizer.token_bytes(i).decode() for i in indices.tolist()}
    assert ids[0] == int(expected[len(PROMPT) - 1].argmax())
    assert choice.logprobs.model_extra["sampling_logprobs"][len(PROMPT):] == [0.0] * 6  # greedy: certain

    sampled = api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6, temperature=0.7, seed=3,
                                     logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = sampled.choices[0].model_extra["token_ids"]
    logits = reference(PROMPT + ids)
    raw, tempered = torch.log_softmax(logits, -1), torch.log_softmax(logits / 0.7, -1)
    lp = sampled.choices[0].logprobs
    for i, token in enumerate(ids):
        position = len(PROMPT) - 1 + i
        assert lp.token_logprobs[i] == pytest.approx(float(raw[position, token]), rel=1e-4, abs=1e-4)
        assert lp.model_extra["sampling_logprobs"][i] == pytest.approx(float(tempered[position, token]),
                                                                        rel=1e-4, abs=1e-4)


def test_choices_share_a_prefill_and_each_replays_from_its_seed(engine):
    api = client(engine)
    many = api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=1.0, n=4, seed=11,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    outputs = [c.model_extra["token_ids"] for c in many.choices]
    assert len({tuple(o) for o in outputs}) > 1, "n choices must be drawn independently"
    assert many.usage.prompt_tokens == len(PROMPT) and many.usage.completion_tokens == 32
    for i in (0, 2):
        alone = api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11 + i,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
        assert alone.choices[0].model_extra["token_ids"] == outputs[i]
    assert many.model_extra["weights_version"] == engine.ready["weights_version"]


def test_sampled_frequencies_match_the_returned_probabilities_in_every_mode(engine):
    """Seeded draws of one token (at a low temperature, where this random model's distribution has
    a few likely tokens): each token's frequency is the probability the engine says it drew with."""
    draws = sample_first_tokens(client(engine), "tiny-chat", PROMPT, temperature=0.03, n=4, requests=80)
    assert_frequencies(draws, threshold=0.1)


def sample_first_tokens(api, model: str, prompt, temperature: float, n: int, requests: int) -> list:
    """(token, its sampling log-probability) for n * requests seeded draws of the first token."""
    draws = []
    for seed in range(0, n * requests, n):
        answer = api.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=temperature, n=n,
                                        seed=seed, logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        draws += [(c.model_extra["token_ids"][0], c.logprobs.model_extra["sampling_logprobs"][0]) for c in answer.choices]
    return draws


def assert_frequencies(draws: list, threshold: float) -> None:
    """Every token drawn with probability >= threshold turns up that often, within 4 sigma."""
    counts, probability = Counter(t for t, _ in draws), {t: math.exp(lp) for t, lp in draws}
    checked = 0
    for token, p in probability.items():
        if p < threshold:
            continue
        sigma = math.sqrt(p * (1 - p) / len(draws))
        assert abs(counts[token] / len(draws) - p) < 4 * sigma, (token, counts[token], len(draws), p)
        checked += 1
    assert checked >= 2, probability


def test_chat_streaming_and_not_with_usage_only_when_asked(engine):
    api = client(engine)
    whole = api.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, temperature=0,
                                        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    message = whole.choices[0].message
    assert whole.object == "chat.completion" and message.role == "assistant" and message.content
    assert len(whole.choices[0].logprobs.content) == 10 and whole.usage.completion_tokens == 10
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    chunks = list(api.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert all(c.choices for c in chunks), "no usage chunk unless stream_options.include_usage"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.model_extra["weights_version"] == engine.ready["weights_version"] for c in chunks)
    with_usage = list(api.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 4
    for text in (c.choices[0].text for c in api.completions.create(
            model="tiny-chat", prompt=PROMPT, max_tokens=4, stream=True, extra_body={"ignore_eos": True})):
        assert isinstance(text, str)  # every chunk has a choice: `chunk.choices[0].text` never raises


@pytest.mark.parametrize("body, message", [
    ({"prompt": PROMPT, "bogus": 1}, "unknown field 'bogus'"),
    ({"prompt": PROMPT, "best_of": 2}, "best_of"),
    ({"prompt": PROMPT, "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "n": 0}, "n must be"),
    ({"prompt": PROMPT, "logprobs": 99}, "logprobs must be"),
    ({"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "needs stream"),
    ({"prompt": PROMPT, "stop": [""]}, "stop must be"),
    ({"prompt": PROMPT, "stop": ""}, "stop must be"),
    ({"prompt": PROMPT, "temperature": float("nan")}, "temperature must be a finite number"),
    ({"prompt": PROMPT, "repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ({"prompt": PROMPT, "seed": 2**64}, "seed must be in"),
    ({"prompt": PROMPT, "temperature": 10**400}, "temperature is out of range"),
    ({"prompt": PROMPT, "seed": 2**63 - 1, "n": 2}, "seed must be in"),
    ({"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage must be"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens must be at least 1"),
    ({"messages": MESSAGES, "tools": []}, "tool calling"),
])
def test_fields_not_supported_are_refused_by_name(tiny_engine, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = urllib.request.Request(tiny_engine.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    answer = json.load(err.value)
    assert err.value.code == 400 and message in answer["error"]["message"], answer


def test_a_checkpoint_without_a_chat_template_gets_a_clear_400(tiny_engine):
    with pytest.raises(openai.BadRequestError, match="no tokenizer.json and so no chat template"):
        client(tiny_engine).chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama, tmp_path_factory):
    runtime = tmp_path_factory.mktemp("api-tiny")
    runtime.chmod(0o700)
    process = EngineProcess(tiny_llama, "safetensors", runtime)
    yield process
    process.stop()


def test_sampled_tokens_follow_the_returned_probabilities(default_engine):
    """Many seeded draws of one token: each token's frequency is the probability the engine says it
    was drawn with (within four standard deviations)."""
    draws = sample_first_tokens(client(default_engine), "smollm2-135m-instruct", "My favourite colour is",
                                temperature=1.0, n=16, requests=20)
    assert_frequencies(draws, threshold=0.05)


def test_chat_answers_with_the_default_model_and_penalties_change_it(default_engine):
    api = client(default_engine)
    answer = api.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, temperature=0)
    assert "Paris" in answer.choices[0].message.content  # no max_tokens: to the end of the answer, not 16 tokens
    assert answer.choices[0].finish_reason == "stop"
    plain = api.completions.create(model="smollm2-135m-instruct", prompt="one two one two one two", max_tokens=12,
                                   temperature=0)
    penalized = api.completions.create(model="smollm2-135m-instruct", prompt="one two one two one two", max_tokens=12,
                                       temperature=0, frequency_penalty=2.0,
                                       extra_body={"repetition_penalty": 1.5})
    assert penalized.choices[0].text != plain.choices[0].text


@pytest.fixture(scope="module")
def default_engine(default_model, tmp_path_factory):
    runtime = tmp_path_factory.mktemp("api-default")
    runtime.chmod(0o700)
    process = EngineProcess(default_model, "safetensors", runtime, "--max-batch", "16")
    yield process
    process.stop()


def test_with_speculation_the_logprobs_are_the_main_models(chat_model, reference, tmp_path_factory):
    """A draft proposes, the main model verifies: the log-probabilities returned are the main
    model's (transformers' log-softmax over the same checkpoint), and stop token ids end a choice."""
    runtime = tmp_path_factory.mktemp("api-spec")
    runtime.chmod(0o700)
    process = EngineProcess(chat_model, "safetensors", runtime, "--speculative", "draft", "--draft-model",
                            str(chat_model), "--num-speculative-tokens", "2")
    try:
        api = client(process)
        answer = api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        ids = answer.choices[0].model_extra["token_ids"]
        expected = torch.log_softmax(reference(PROMPT + ids), -1)
        for i, token in enumerate(ids):
            assert answer.choices[0].logprobs.token_logprobs[i] == pytest.approx(
                float(expected[len(PROMPT) - 1 + i, token]), rel=1e-4, abs=1e-4)
        stopped = api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]],
                                                     "return_token_ids": True})
        assert stopped.choices[0].model_extra["token_ids"] == ids[:2] and stopped.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="not supported with speculative decoding"):
            api.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2, presence_penalty=1.0)
    finally:
        process.stop()


def test_stop_prefix_is_the_longest_end_of_the_text_a_stop_string_begins_with():
    from worker.server import stop_prefix
    assert stop_prefix("The capital is Par", " Paris.") == 4
    assert stop_prefix("The capital is", " Paris.") == 0
    assert stop_prefix("aaa", "aab") == 2  # not 1: the longest
    assert stop_prefix("xab", "abc") == 2 and stop_prefix("aba", "ab") == 1 and stop_prefix("ab", "ab") == 0
    assert stop_prefix("", "ab") == 0 and stop_prefix("a" * 10_000, "a" * 1024) == 1023


@pytest.mark.parametrize("raw, status, message", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, "the text cannot be tokenized"),
    (b'{"prompt": "' + b"a" * ((8 << 20) + 1) + b'", "max_tokens": 1}', 400, "over 8388608 characters"),
    (b'{"prompt": "' + b"a" * (1 << 20) + b'", "max_tokens": 1}', 400,  # EngineProcess: --max-model-len 256
     "the prompt's text is 1048576 characters, more than this engine's context of 256 tokens can hold (65536 "),
    (b'{"messages": [' + b",".join([b'{"role": "user", "content": "' + b"a" * (1 << 20) + b'"}'] * 9) + b"]}", 400,
     "the messages hold 9437184 characters in all, over the 8388608-character limit"),
    (b'{"messages": [' + b",".join([b'{"role": "user", "content": ""}'] * 65_537) + b"]}", 400,
     "65537 messages is over the limit of 65536"),
])
def test_hostile_bodies_get_a_400_that_names_the_problem(default_engine, raw, status, message):
    """Before: a traceback and a plain-text 500 (deep nesting), the tokenizer's 'TextInputSequence
    must be str' (a lone surrogate), 8 s of tokenizing on the event loop before the length check
    (and then, off the loop but holding the GIL, 8 s for a prompt far longer than the context),
    and chat messages of 64 MiB sent whole to the template's renderer (a second of the engine's
    time to encode)."""
    path = "/v1/chat/completions" if raw.startswith(b'{"messages"') else "/v1/completions"
    request = urllib.request.Request(default_engine.url + path, raw, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    answer = json.load(err.value)
    assert err.value.code == status and message in answer["error"]["message"], answer
    assert urllib.request.urlopen(default_engine.url + "/health", timeout=10).status == 200


def test_a_renderer_that_does_not_answer_gets_a_503_and_the_next_chat_a_new_one(default_engine):
    """The chat template renderers (worker/template_process.py) stopped, as by an overloaded host or
    a debugger: a chat gets a 503 that says to send it again once the render's time has passed (not
    a 500 blaming the template, nor an answer never sent), and the next chat gets a new renderer."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": 4, "temperature": 0}).encode()

    def chat():
        request = urllib.request.Request(default_engine.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=60)

    assert chat().status == 200  # a renderer is running
    renderers = [c for c in psutil.Process(default_engine.proc.pid).children(recursive=True)
                 if "worker.template_process" in c.cmdline()]
    assert renderers
    for child in renderers:
        child.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            chat()
        answer = json.load(err.value)
        assert err.value.code == 503 and "did not take the request within 7 s" in answer["error"]["message"], answer
        assert 6 < time.monotonic() - started < 30
        assert json.load(chat())["choices"][0]["message"]["content"]
    finally:
        for child in renderers:
            if child.is_running():
                child.send_signal(signal.SIGCONT)
    psutil.wait_procs(renderers, timeout=10)  # the stopped one was killed, not left behind
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in renderers)


def engine_counter(engine, name: str) -> float:
    metrics = urllib.request.urlopen(engine.url + "/metrics", timeout=10).read().decode()
    return float(re.search(rf"^preload_engine_{name}(?:_total)?{{[^}}]*}} (\S+)$", metrics, re.M).group(1))


def test_a_client_that_leaves_a_non_streamed_request_stops_its_generation(tiny_engine):
    """400 prompts of 200 tokens, queued behind a batch of 4: the client gives up after a second.
    The engine stops their generation, and drops the prompts still queued without prefilling them
    (before: it prefilled and generated every one, for a client that was gone)."""
    before = engine_counter(tiny_engine, "requests")
    body = {"prompt": [[5, 6, 7]] * 400, "max_tokens": 200, "ignore_eos": True}
    request = urllib.request.Request(tiny_engine.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(request, timeout=1)
    counts = [engine_counter(tiny_engine, "requests")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (len(counts) < 3 or counts[-1] != counts[-3]):
        time.sleep(0.5)
        counts.append(engine_counter(tiny_engine, "requests"))
    assert time.monotonic() < deadline and counts[-1] - before < 50, counts  # a batch or two had started
    # Still serving. ignore_eos: the default temperature samples, and the tiny model may pick its EOS.
    ok = client(tiny_engine).completions.create(model="tiny-llama", prompt=[5, 6], max_tokens=2,
                                                extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 2


def _metaspace_tokenizer():
    """A Llama-style decoder (SentencePiece's ▁ for spaces, byte fallback, the first space stripped)."""
    import tokenizers
    from tokenizers import decoders, models
    vocab = {"▁Hello": 0, "▁world": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "!": 5, "▁": 6, "é": 7, "</s>": 8}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="!"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])
    return tok, len(vocab)


@pytest.mark.parametrize("kind", ["default", "metaspace"])
def test_text_decoded_token_by_token_is_the_whole_decode(default_model, kind):
    """A choice's text is decoded incrementally (it was decoded whole on every token: quadratic);
    at every token it must equal decoding all of them (a partial character at the end stands as one
    replacement character), special tokens included, with byte-level (the default model) and
    SentencePiece-style decoders; and each token's start (text_offset) is where its text begins."""
    from worker.tokenizer import MAX_CONTEXT_TOKENS, IncrementalText
    if kind == "default":
        tok = Tokenizer(default_model)._tok
        size = tok.get_vocab_size()
        texts = ["Emoji party: 🎉🎉 and Japanese 日本語, naïve café", "x" * 50 + " 🙂" * 20]
        sequences = [tok.encode(t).ids for t in texts]
    else:
        tok, size = _metaspace_tokenizer()  # "€€" in byte tokens; a word after more specials than the context keeps
        sequences = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 2, 3, 0, 4, 1], [0, 2, 3, 4, 2, 3, 4, 1],
                     [1] + [8] * (MAX_CONTEXT_TOKENS + 5) + [0], [8] * (MAX_CONTEXT_TOKENS + 5) + [6, 1]]
    real = len(sequences)  # then random ids: bytes that make no character, which a byte-fallback decoder
    generator = torch.Generator().manual_seed(0)  # turns into replacement characters back to the run's start
    sequences += [torch.randint(0, size, (400,), generator=generator).tolist() for _ in range(5)]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    for n, ids in enumerate(sequences):
        text = IncrementalText(decode)
        for i, token in enumerate(ids):
            text.add(token)
            whole = decode(ids[:i + 1])  # a partial character at the end stands as replacement characters
            assert text.text == whole or whole.endswith("\ufffd") and text.text.endswith("\ufffd") and \
                text.text.startswith(text.settled), (kind, ids[:i + 1])
        assert (text.incremental or n >= real) and text.starts == sorted(text.starts)
    if kind == "default":  # the emoji's bytes span tokens: each begins where the emoji does
        ids = tok.encode("a🎉b").ids
        text = IncrementalText(decode)
        text.extend(ids)
        assert len(ids) > 3 and text.starts == [0] + [1] * (len(ids) - 2) + [2]
    else:
        text = IncrementalText(decode)
        assert text.extend([0, 2, 3, 4, 2, 3, 4, 1]) == "Hello€€ world"
        assert text.starts == [0, 5, 5, 5, 6, 6, 6, 7]
