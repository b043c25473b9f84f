"""The generation engine in-process: sampling, stopping, batching."""

import re
import threading
import time

import pytest

from preload_daemon.errors import InvalidRequestError
from worker.engine import Engine
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM
from worker.requests import SamplingParams
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


def test_seeds_that_differ_in_their_high_bits_draw_differently(engine):
    """torch's CPU generator keeps 32 bits of a seed: 5, 5 + 2**32 and 5 - 2**40 drew alike."""
    draws = {seed: engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=seed,
                                                          ignore_eos=True)).tokens
             for seed in (5, 5 + 2**32, 5 - 2**40, 0, -2**63, 2**63 - 1)}
    assert len({tuple(tokens) for tokens in draws.values()}) == len(draws), draws


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
    ([1] * 128, SamplingParams(max_tokens=1), r"the prompt \(128 tokens\) leaves no room in the engine's max length"),
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
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (float("nan"), float("inf")):  # JSON's NaN and Infinity parse as floats
            with pytest.raises(InvalidRequestError, match=f"{name} must be a finite number"):
                SamplingParams(**{name: value})


def test_a_temperature_too_small_to_divide_by_is_greedy(engine):
    """logits / 1e-40 overflow to inf, from which nothing can be sampled: below 1e-5 is greedy."""
    assert SamplingParams(temperature=1e-40).temperature == 0 and SamplingParams(temperature=1e-5).temperature == 1e-5
    greedy = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    tiny = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-40, seed=3))
    assert tiny.tokens == greedy.tokens


def generate(engine, prompt, params, timeout=60) -> tuple[list[int], str]:
    """engine.generate with a bound: (tokens, finish reason); fails if the engine never answers."""
    tokens, reasons, done = [], [], threading.Event()
    engine.submit(prompt, params, tokens.append, lambda r: (reasons.append(r), done.set()))
    assert done.wait(timeout), "the engine never finished the request (its scheduler died?)"
    return tokens, reasons[0]


def test_extreme_penalties_and_small_temperatures_still_sample(engine):
    """A repetition penalty near 0 pushes the seen tokens' logits past float32's range, and a small
    temperature divides them further: the request still samples, and the scheduler lives on."""
    for penalty, temperature in ((1e-40, 1.0), (1e-40, 1e-5), (10.0, 1e-5)):
        tokens, reason = generate(engine, PROMPT, SamplingParams(max_tokens=6, temperature=temperature, seed=1,
                                                                 repetition_penalty=penalty, ignore_eos=True,
                                                                 logprobs=2))
        assert reason == "length" and len(tokens) == 6
    assert generate(engine, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[1] == "length"


def test_logits_that_are_not_finite_end_that_request_and_the_engine_serves_on(tiny_llama):
    """A checkpoint with a NaN in its lm_head: sampling from its logits (or their log-probabilities)
    fails. That request ends with an error that names the cause, and the scheduler goes on: before,
    the exception ended the scheduler's thread and every later request waited forever."""
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(tiny_llama))))
    model = CausalLM.from_config(weights.config, weights.tensors)
    good = model.lm_head
    model.lm_head = good.clone()
    model.lm_head[7] = float("nan")
    engine = Engine(model, max_batch=4, max_len=128).start()
    try:
        for params in (SamplingParams(max_tokens=4, temperature=1.0, seed=1), SamplingParams(max_tokens=4, logprobs=1),
                       SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, prompt_logprobs=0)):
            _, reason = generate(engine, PROMPT, params)
            assert re.fullmatch("error: (cannot choose the next token: )?the model's logits hold NaN or infinity: its "
                                "weights do .*", reason), reason
        assert engine._thread.is_alive()
        model.lm_head = good  # the same engine, its weights mended: it still serves
        tokens, reasons, done = [], [], threading.Event()

        def poison(token):  # on the engine's thread, between the prefill and the first decode step
            tokens.append(token)
            model.lm_head = bad
        bad = model.lm_head.clone()
        bad[7] = float("nan")
        engine.submit(PROMPT, SamplingParams(max_tokens=4), poison, lambda r: (reasons.append(r), done.set()))
        assert done.wait(60) and len(tokens) == 1 and "the model's logits hold NaN" in reasons[0], (tokens, reasons)
        model.lm_head = good  # a plain greedy row of a decode step is checked too (argmax took the NaN's index)
        assert generate(engine, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[1] == "length"
    finally:
        engine.stop()


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


def test_a_caller_that_fails_cancels_only_its_own_request(engine):
    """A callback that raises (a server's event loop closed under it) ends that request with "stop";
    the scheduler goes on serving the others."""
    def gone(token):
        raise RuntimeError("Event loop is closed")

    reasons, done = [], threading.Event()
    engine.submit(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True), gone, lambda r: (reasons.append(r), done.set()))
    assert done.wait(60) and reasons == ["stop"]
    assert engine.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)).finish_reason == "length"


def test_parking_ends_the_requests_still_queued(engine):
    """A request queued behind running ones when the engine parks has nobody waiting for it (the
    HTTP server closed first): it ends with an error instead of outliving the quiet point."""
    release, started = threading.Event(), threading.Event()

    def hold(token):  # the engine's thread waits here once every slot is busy
        if len(engine._running) == 4:
            started.set()
            release.wait(60)

    running, queued = [], []
    for _ in range(4):  # every slot busy, so the next request queues
        engine.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), hold, running.append)
    assert started.wait(60)
    engine.submit([1, 2, 3], SamplingParams(max_tokens=2), lambda t: None, queued.append)
    parked = []
    pauser = threading.Thread(target=lambda: parked.append(engine.pause(60)))
    pauser.start()
    release.set()
    pauser.join(60)
    try:
        assert parked == [True]
        assert running == ["length"] * 4 and queued == ["error: the engine paused for a snapshot"]
    finally:
        engine.resume()
    assert engine.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)).finish_reason == "length"


def test_pause_parks_the_scheduler_and_generate_parked_runs_its_path(engine):
    """A snapshot's quiet point: pause waits for running requests, new ones wait; generate_parked
    gives what the scheduler gives, with log-probabilities that are the model's log-softmax."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    scheduled = engine.generate(PROMPT, params)
    with pytest.raises(RuntimeError, match="parked"):
        engine.generate_parked(PROMPT, params)
    assert engine.pause(30)
    done = threading.Event()
    engine.submit([1, 2, 3], SamplingParams(max_tokens=2), lambda t: None, lambda r: done.set())
    parked = engine.generate_parked(PROMPT, params)
    assert not done.wait(0.3), "a request ran while the scheduler was parked"
    engine.resume()
    assert done.wait(30)
    assert parked.tokens == scheduled.tokens and parked.logprobs == pytest.approx(scheduled.logprobs, abs=1e-5)
    assert len(parked.logprobs) == 6 and all(lp <= 0 for lp in parked.logprobs)
    import torch
    logits = engine.model.forward(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], engine.cache,
                                  torch.tensor([0]))
    first = torch.log_softmax(logits[0].float(), -1)[scheduled.tokens[0]]
    assert scheduled.logprobs[0] == pytest.approx(float(first), abs=1e-5)


def test_a_held_request_cancelled_while_it_waits_for_slots_does_not_block_the_queue(tiny_llama):
    """n = 2 choices wait for two free slots, in order; cancelled meanwhile (its client left), they
    must not hold up a one-slot request queued behind them until the running one ends."""
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(tiny_llama))))
    engine = Engine(CausalLM.from_config(weights.config, weights.tensors), max_batch=2, max_len=256).start()
    try:
        order, done = [], threading.Semaphore(0)
        long_done = threading.Event()
        engine.submit(PROMPT, SamplingParams(max_tokens=250, ignore_eos=True), lambda t: time.sleep(0.004),
                      lambda r: (order.append("long"), long_done.set()))  # a second at least
        held = engine.submit_choices(PROMPT, [SamplingParams(max_tokens=2)] * 2, [lambda t: None] * 2,
                                     [lambda r: (order.append("held"), done.release())] * 2)
        deadline = time.monotonic() + 30
        while not engine._held and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine._held, "the two choices never waited for slots"
        for request in held:
            request.cancelled = True
        engine.submit(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), lambda t: None,
                      lambda r: (order.append("small"), done.release()))
        for _ in range(3):
            assert done.acquire(timeout=60)
        assert order[:3] == ["held", "held", "small"], order
        assert long_done.wait(120)
    finally:
        engine.stop()
