"""The generation engine in-process: sampling, stopping, batching."""

import threading

import pytest

from preload_daemon.errors import InvalidRequestError
from worker.engine import Engine, SamplingParams
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM
from preload_daemon.plan import LoadSpec


@pytest.fixture(scope="module")
def engine(tiny_llama):
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(tiny_llama))))
    engine = Engine(CausalLM.from_config(weights.config, weights.tensors), max_batch=4, max_len=128)
    yield engine.start()
    engine.stop()


PROMPT = [5, 17, 99, 3, 200]


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first, second = engine.generate(PROMPT, params), engine.generate(PROMPT, params)
    other = engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True))
    assert first.tokens == second.tokens and first.tokens != other.tokens


def test_stop_tokens_and_max_tokens(engine):
    greedy = engine.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 10
    stop_at = greedy.tokens[3]
    stopped = engine.generate(PROMPT, SamplingParams(max_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))
    first = greedy.tokens.index(stop_at)
    assert stopped.finish_reason == "stop" and stopped.tokens == greedy.tokens[:first]


def test_concurrent_requests_are_batched_and_unchanged(engine):
    """Four requests submitted together decode in shared steps and give the tokens each gives alone."""
    prompts = [PROMPT, [1, 2, 3], [9] * 7, [100, 4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [engine.generate(p, params).tokens for p in prompts]
    steps_before = engine.stats["decode_steps"]
    results, finished = [[] for _ in prompts], threading.Semaphore(0)
    for i, p in enumerate(prompts):
        engine.submit(p, params, results[i].append, lambda reason: finished.release())
    for _ in prompts:
        assert finished.acquire(timeout=60)
    assert results == alone
    assert engine.stats["decode_steps"] - steps_before < len(prompts) * 11, "requests were decoded one by one"


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ([1] * 120, SamplingParams(max_tokens=20), "exceeds the engine's max length 128"),
    ([10**6], SamplingParams(), "token ids must be in"),
])
def test_bad_requests(engine, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(prompt, params, lambda t: None, lambda r: None)


def test_bad_sampling_params():
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_stopping_ends_every_open_request_with_an_error(tiny_llama):
    """Requests running or just submitted when the engine stops are told so: nobody waits forever,
    and a caller that is gone (its callback raises) does not stop the others being told."""
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(tiny_llama))))
    engine = Engine(CausalLM.from_config(weights.config, weights.tensors), max_batch=4, max_len=4096).start()
    limit = engine.max_len - len(PROMPT)  # the tiny model's context
    reasons, first_token = [], threading.Event()

    def gone(reason):
        raise RuntimeError("event loop is closed")

    def hold(token):  # the engine's thread waits here until stop() has queued its sentinel
        first_token.set()
        stop_queued.wait(60)

    params, stop_queued = SamplingParams(max_tokens=limit, ignore_eos=True), threading.Event()
    engine.submit(PROMPT, params, hold, gone)
    engine.submit(PROMPT, params, lambda t: None, reasons.append)
    assert first_token.wait(60)
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    while engine._pending.empty():
        stopper.join(0.01)
    stop_queued.set()
    stopper.join(60)
    assert not stopper.is_alive() and reasons == ["error: the engine stopped"]
