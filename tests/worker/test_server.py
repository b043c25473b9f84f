"""Engine workers as real processes: warm and cold starts, fallback, readiness, the HTTP API."""

import json
import os
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from preload_daemon.plan import LoadSpec
from tests.conftest import copy_checkpoint, wait_until
from tests.worker.conftest import post
from worker.loader import FallbackRefusedError, LoadRequest, load_ipc_cache, load_safetensors

PROMPT = [5, 17, 99, 3, 200, 41]


def complete(engine, prompt=PROMPT, **kwargs) -> dict:
    return post(engine.url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, **kwargs})


def test_warm_and_cold_weights_are_bit_identical(daemon, tiny_llama):
    daemon.client.load(LoadSpec(path=str(tiny_llama), dtype="bfloat16"))
    request = LoadRequest(spec=LoadSpec(path=str(tiny_llama), dtype="bfloat16"), runtime_dir=daemon.config.runtime_dir,
                          fallback=False)
    warm, cold = load_ipc_cache(request), load_safetensors(request)
    assert warm.load_format == "ipc_cache" and cold.load_format == "safetensors"
    assert warm.tensors.keys() == cold.tensors.keys()
    for name in warm.tensors:
        assert torch.equal(warm.tensors[name].view(torch.uint8), cold.tensors[name].view(torch.uint8)), name


def test_warm_and_cold_engines_answer_identically(daemon, tiny_llama, start_engine):
    """Two warm engines map one slab (two leases, one copy); a cold engine gives the same tokens."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    warm_a = start_engine(tiny_llama, "ipc_cache", "--no-fallback")
    warm_b = start_engine(tiny_llama, "ipc_cache", "--no-fallback")
    cold = start_engine(tiny_llama, "safetensors")
    assert [e.ready["load_format"] for e in (warm_a, warm_b, cold)] == ["ipc_cache", "ipc_cache", "safetensors"]
    for key in ("process_start", "weights_start", "weights_done", "ready"):
        assert key in warm_a.ready
    outputs = [complete(e) for e in (warm_a, warm_b, cold)]
    assert outputs[0]["usage"]["completion_tokens"] == 12
    assert outputs[0]["choices"] == outputs[1]["choices"] == outputs[2]["choices"]
    leases = daemon.client.list_models()[0].leases
    assert sorted(lease.pid for lease in leases) == sorted([warm_a.proc.pid, warm_b.proc.pid])
    slab = daemon.client.attach("tiny-llama").manifest.slabs[0].path
    for engine in (warm_a, warm_b):
        assert slab in open(f"/proc/{engine.proc.pid}/maps").read()


def test_fallback_when_the_daemon_is_absent(runtime_dir, tiny_llama, start_engine):
    engine = start_engine(tiny_llama, "ipc_cache")
    assert engine.ready["load_format"] == "safetensors"
    assert "DaemonUnavailableError" in engine.ready["fallback_reason"]
    assert complete(engine)["usage"]["completion_tokens"] == 12


def test_no_fallback_fails_with_the_reason(runtime_dir, tiny_llama, start_engine):
    engine = start_engine(tiny_llama, "ipc_cache", "--no-fallback")
    assert engine.ready["event"] == "failed"
    assert engine.proc.wait(30) == 1
    assert "ipc_cache unavailable: DaemonUnavailableError" in engine.ready["error"]
    assert "--no-fallback is set" in engine.ready["error"]


def test_stale_checkpoint_is_never_served_warm(daemon, tiny_llama, tmp_path, start_engine):
    ckpt = tmp_path / "ckpt"
    tensors = copy_checkpoint(tiny_llama, ckpt)
    daemon.client.load(LoadSpec(path=str(ckpt)))
    file = ckpt / "model.safetensors"
    old = os.stat(file)
    save_file({k: v * 2 for k, v in tensors.items()}, str(tmp_path / "new"))  # same shapes, new values
    with open(file, "r+b") as f:  # written over in place, the old mtime put back (`cp -p`)
        f.write((tmp_path / "new").read_bytes())
    os.utime(file, ns=(old.st_atime_ns, old.st_mtime_ns))
    with pytest.raises(FallbackRefusedError, match="StaleError.*ctime_ns"):
        load_ipc_cache(LoadRequest(spec=LoadSpec(path=str(ckpt)), runtime_dir=daemon.config.runtime_dir,
                                   fallback=False))
    engine = start_engine(ckpt, "ipc_cache")
    assert engine.ready["load_format"] == "safetensors" and "StaleError" in engine.ready["fallback_reason"]
    fresh = load_safetensors(LoadRequest(spec=LoadSpec(path=str(ckpt))))
    assert torch.equal(fresh.tensors["model.norm.weight"], tensors["model.norm.weight"] * 2)


def test_ready_is_not_200_before_ready(runtime_dir, tmp_path, start_engine):
    """While a cold load is in flight, /health answers 200 and /ready 503 with a reason."""
    from preload_cli.models import synthetic_checkpoint
    ckpt = synthetic_checkpoint(tmp_path / "synth", 0.3, hidden=512)
    engine = start_engine(ckpt, "safetensors", "--port", "0", wait=False)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and 200 not in seen:
        for port in _listening_ports(engine.proc.pid):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5)
                seen.append(200)
            except urllib.error.HTTPError as e:
                assert e.code == 503 and json.load(e)["reason"] == "loading weights"
                assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200
                seen.append(503)
            except urllib.error.URLError:
                pass
        time.sleep(0.01)
    assert seen and seen[0] == 503 and seen[-1] == 200


def _listening_ports(pid: int) -> list[int]:
    import psutil
    try:
        return [c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.NoSuchProcess:
        return []


def test_http_api_errors_and_streaming(runtime_dir, tiny_llama, start_engine):
    engine = start_engine(tiny_llama, "safetensors", "--max-model-len", "1000")
    models = json.load(urllib.request.urlopen(engine.url + "/v1/models"))
    assert models["data"][0]["id"] == "tiny-llama"
    for body, status, message in [
        ({"prompt": "text"}, 400, "no tokenizer.json"),
        ({"prompt": PROMPT, "model": "other"}, 404, "'other' is not served here"),
        ({"prompt": {"a": 1}}, 400, "prompt must be"),
        ({"prompt": PROMPT, "top_p": 5}, 400, "top_p"),
        ({"prompt": "x" * (64 << 20)}, 413, "over 64 MiB; send a shorter prompt"),
        ({"prompt": [[1]] * 1025, "n": 4}, 400, "1025 prompts x n=4 are 4100 choices, over the limit of 4096"),
        ({"prompt": PROMPT, "stop_token_ids": [10**30]}, 400, "stop_token_ids must be in [0, 256)"),
    ]:
        with pytest.raises(urllib.error.HTTPError) as err:
            post(engine.url + "/v1/completions", body)
        assert err.value.code == status and message in json.load(err.value)["error"]["message"]
    for request, status, message in [  # OpenAI clients read every error as JSON
        (urllib.request.Request(engine.url + "/v1/embeddings", b"{}"), 404,
         "no such path '/v1/embeddings'; this engine serves /health, /ready, /metrics, /v1/models"),
        (urllib.request.Request(engine.url + "/v1/completions"), 405, "GET is not allowed on /v1/completions")]:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == status and message in json.load(err.value)["error"]["message"]
        assert status == 404 or err.value.headers["Allow"] == "POST"
    batch = complete(engine, prompt=[PROMPT, PROMPT[:3]])
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["usage"]["completion_tokens"] == 24
    metrics = urllib.request.urlopen(engine.url + "/metrics").read().decode()
    assert 'preload_engine_ready{model="tiny-llama",replica="0"} 1.0' in metrics
    assert "--max-model-len 1000 is past the model's max_position_embeddings (256)" in engine.stop()


def test_openai_client_against_the_default_model(runtime_dir, default_model, start_engine):
    openai = pytest.importorskip("openai")
    engine = start_engine(default_model, "safetensors")
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    result = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                       max_tokens=8, temperature=0)
    assert "Paris" in result.choices[0].text
    chunks = list(client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                            max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[0].text
    stopped = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                        max_tokens=8, temperature=0, stop=["Paris"])
    assert "Paris" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    # Streamed, the text that may begin the stop string waits for the next token: " Paris" is held
    # until "." ends the stop string, and nothing of it goes out (it did before).
    stop = result.choices[0].text[result.choices[0].text.index(" Paris"):][:len(" Paris") + 1]
    assert len(stop) == len(" Paris") + 1, result.choices[0].text
    for stream in (False, True):
        out = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                        max_tokens=8, temperature=0, stop=[stop], stream=stream)
        text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
        assert text == result.choices[0].text[:result.choices[0].text.index(stop)], (stream, text)
    # Characters split across tokens: their log-probabilities' bytes join into the text (each token had
    # the replacement character's), and text_offset points at each token's text (it drifted by 2 an emoji).
    chat = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "Reply with only "
                                                                     "these emoji: 🎉🙂🌍"}])
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == chat.choices[0].message.content
    guarded = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=12, temperature=0,
                                             stop=["\ufffd"], messages=[{"role": "user", "content": "Reply with only "
                                                                          "these emoji: 🎉🙂🌍"}])
    assert guarded.choices[0].message.content == chat.choices[0].message.content  # a partial emoji is no U+FFFD
    assert any(t.token.startswith("bytes:") for t in content), "no character was split across tokens"
    prompt = "Emoji party: 🎉🎉 and Japanese 日本語"
    echoed = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=12, temperature=0,
                                       logprobs=2, echo=True).choices[0]
    text, tokens, offsets = echoed.text, echoed.logprobs.tokens, echoed.logprobs.text_offset
    assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[0] == 0
    for token, at in zip(tokens, offsets):
        assert token.startswith("bytes:") or text[at:].startswith(token), (token, at, text)


def test_engine_survives_a_killed_daemon_and_reattaches_to_its_successor(daemon, tiny_llama, start_engine,
                                                                        start_daemon):
    """kill -9 of the daemon: the engine goes on serving from the mapped slab and says degraded in
    /health; a new daemon on the device adopts the slab (no checkpoint read, same digest, same
    version numbering) and the engine re-attaches on its own."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    digest = daemon.client.list_models()[0].key.content_digest
    slabs = sorted(p.name for p in daemon.config.shm_dir.glob("*.slab"))
    engine = start_engine(tiny_llama, "ipc_cache", "--no-fallback")
    before = complete(engine)["choices"][0]["text"]
    daemon.proc.kill()
    daemon.proc.wait()
    health = wait_for_health(engine, "degraded")
    assert "lost the daemon on cpu:0" in health["reason"], health
    assert urllib.request.urlopen(engine.url + "/ready").status == 200
    assert complete(engine)["choices"][0]["text"] == before
    successor = start_daemon()
    wait_for_health(engine, "alive")
    [info] = successor.client.list_models()
    assert (info.version, info.key.content_digest) == (1, digest)
    assert [lease.pid for lease in info.leases] == [engine.proc.pid]
    assert sorted(p.name for p in successor.config.shm_dir.glob("*.slab")) == slabs
    stats = successor.client.stats()
    assert any(line.startswith("adopted tiny-llama v1") for line in stats.recovery), stats.recovery
    assert "loaded tiny-llama" not in successor.output()  # adopted, not read again
    assert complete(engine)["choices"][0]["text"] == before
    metrics = urllib.request.urlopen(engine.url + "/metrics").read().decode()
    assert 'preload_engine_reattached_total{model="tiny-llama",replica="0"} 1.0' in metrics
    assert successor.client.load(LoadSpec(path=str(tiny_llama), dtype="float16")).version == 1
    engine.stop()
    wait_until(lambda: not successor.client.list_models()[0].leases, timeout=10, what="the engine's lease to end")


def test_an_engine_reattached_to_its_bytes_under_a_new_number_answers_with_that_number(daemon, tiny_llama, tmp_path,
                                                                                      start_engine, start_daemon):
    """A daemon stopped gently frees its slabs and its successor numbers from 1: the engine found its
    bytes again under another number, but went on naming the old one, which the new daemon may give
    to other weights."""
    copy_checkpoint(tiny_llama, tmp_path / "other")
    daemon.client.load(LoadSpec(path=str(tmp_path / "other"), name="tiny-llama"))
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    engine = start_engine(tiny_llama, "ipc_cache", "--no-fallback")
    assert engine.ready["weights_version"] == 2
    daemon.proc.terminate()
    daemon.proc.wait(timeout=30)
    wait_for_health(engine, "degraded")
    successor = start_daemon()
    assert successor.client.load(LoadSpec(path=str(tiny_llama))).version == 1
    wait_for_health(engine, "alive")
    ready = json.load(urllib.request.urlopen(engine.url + "/ready"))
    assert ready["weights_version"] == 1
    assert complete(engine)["weights_version"] == 1
    assert "as v1 (the same bytes)" in engine.stop()


def test_an_engine_whose_version_is_evicted_by_force_says_so_and_reattaches(daemon, tiny_llama, start_engine):
    """`preload evict m@1 --force` ended the engine's lease, and it went on saying alive, holding none."""
    daemon.client.load(LoadSpec(path=str(tiny_llama)))
    engine = start_engine(tiny_llama, "ipc_cache", "--no-fallback")
    before = complete(engine)["choices"][0]["text"]
    daemon.client.evict("tiny-llama", 1, True)
    health = wait_for_health(engine, "degraded")
    assert "the daemon on cpu:0 ended the lease of tiny-llama v1" in health["reason"], health
    assert complete(engine)["choices"][0]["text"] == before  # still served, from the mapped slab
    assert daemon.client.load(LoadSpec(path=str(tiny_llama))).version == 2
    wait_for_health(engine, "alive")
    assert json.load(urllib.request.urlopen(engine.url + "/ready"))["weights_version"] == 2
    assert [lease.pid for lease in daemon.client.list_models()[0].leases] == [engine.proc.pid]


def wait_for_health(engine, status: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = json.load(urllib.request.urlopen(engine.url + "/health"))
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, f"/health stayed {body}"
        time.sleep(0.1)