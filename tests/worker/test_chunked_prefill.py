"""A long prompt that arrives while others decode is prefilled in parts, a decode step of the others
between its parts: what each request gets is what it gets alone (float32), and a part-prefilled
request that is cancelled, fails, or is caught by the engine stopping ends cleanly."""

import threading

import pytest

from preload_daemon.plan import LoadSpec
from worker.engine import Engine
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM
from worker.requests import SamplingParams

SHORT = [5, 17, 99, 3, 200]
LONG = [(i * 37) % 250 + 1 for i in range(40)]
CHUNK = 8


@pytest.fixture(scope="module")
def model(tiny_llama):
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(tiny_llama))))
    return CausalLM.from_config(weights.config, weights.tensors)


class Recorder:
    """Wraps a model's forward: records (rows, first position, last position + 1) of each call, and
    runs `hook(call)` before the call made with index `at`."""

    def __init__(self, model, hook=None, at=-1):
        self.calls, self.hook, self.at, self.engine = [], hook, at, None
        self.forward = model.forward

    def __call__(self, ids, positions, *args, **kwargs):
        self.calls.append((ids.shape[0], int(positions[0, 0]), int(positions[0, -1]) + 1))
        if len(self.calls) - 1 == self.at:
            self.hook(self.engine)
        return self.forward(ids, positions, *args, **kwargs)

    def _parts(self):
        return [i for i, (rows, a, b) in enumerate(self.calls)
                if rows == 1 and a % CHUNK == 0 and (b - a == CHUNK or b == len(LONG) > a)]

    def parts(self):
        """The prefill calls of the long prompt: (first position, end)."""
        return [self.calls[i][1:] for i in self._parts()]

    def decodes_between_parts(self):
        index = self._parts()
        return [sum(1 for _, a, b in self.calls[i + 1:j] if b - a == 1) for i, j in zip(index, index[1:])]


def alone(model, prompt, params):
    engine = Engine(model, max_batch=4, max_len=128, prefill_chunk=0).start()
    try:
        return engine.generate(prompt, params).tokens
    finally:
        engine.stop()


def together(model, recorder, short_params, long_n=1, long_params=None, chunk=CHUNK):
    """The short request and the long one queued before the scheduler starts: the short one is
    prefilled first (shorter prompts first), so the long one arrives while it decodes."""
    long_params = long_params or SamplingParams(max_tokens=6, ignore_eos=True)
    engine = Engine(model, max_batch=4, max_len=128, prefill_chunk=chunk)
    model.forward, recorder.engine = recorder, engine
    out, reasons, done = {"short": [], "long": [[] for _ in range(long_n)]}, {}, threading.Semaphore(0)

    def finished(key):
        return lambda reason: (reasons.__setitem__(key, reason), done.release())

    try:
        engine.submit(SHORT, short_params, out["short"].append, finished("short"))
        longs = engine.submit_choices(LONG, [long_params] * long_n, [t.append for t in out["long"]],
                                      [finished(f"long{i}") for i in range(long_n)])
        engine.start()
        for _ in range(1 + long_n):
            assert done.acquire(timeout=60)
        assert sorted(engine._free) == [0, 1, 2, 3] and not engine._filling and not engine._running
        return out, reasons, longs, engine
    finally:
        del model.forward
        engine.stop()


def test_a_long_prompt_is_prefilled_in_parts_between_decode_steps_and_both_answers_are_unchanged(model):
    short_params = SamplingParams(max_tokens=30, ignore_eos=True)
    long_params = SamplingParams(max_tokens=6, ignore_eos=True)
    recorder = Recorder(model)
    out, reasons, _, engine = together(model, recorder, short_params)
    assert recorder.parts() == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert recorder.decodes_between_parts() == [1, 1, 1, 1], recorder.calls
    assert reasons == {"short": "length", "long0": "length"}
    assert out["short"] == alone(model, SHORT, short_params)
    assert out["long"][0] == alone(model, LONG, long_params)
    assert engine.stats["prompt_tokens"] == len(SHORT) + len(LONG) and engine.stats["prefill_parts"] == 5


def test_the_rest_of_a_prompt_goes_whole_once_nothing_else_runs(model):
    recorder = Recorder(model)
    out, reasons, _, _ = together(model, recorder, SamplingParams(max_tokens=2, ignore_eos=True))
    assert recorder.parts() == [(0, 8), (8, 40)]  # the short request ended after the first part
    assert out["long"][0] == alone(model, LONG, SamplingParams(max_tokens=6, ignore_eos=True))


def test_choices_of_a_prompt_prefilled_in_parts_copy_its_cache(model):
    recorder = Recorder(model)
    out, reasons, _, _ = together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True), long_n=2)
    expected = alone(model, LONG, SamplingParams(max_tokens=6, ignore_eos=True))
    assert out["long"] == [expected, expected] and len(recorder.parts()) == 5


def test_chunking_off_prefills_whole(model):
    recorder = Recorder(model)
    together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True), chunk=0)
    assert recorder.parts() == [(0, 40)]


def test_a_cancelled_prompt_stops_being_prefilled_and_gives_back_its_slot(model):
    def cancel(engine):  # the client goes away while the second part runs
        engine._filling[0].cancelled = True

    recorder = Recorder(model, hook=cancel, at=3)  # calls: short, part 1, a decode, part 2
    out, reasons, _, _ = together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True))
    assert reasons == {"short": "length", "long0": "stop"} and out["long"] == [[]]
    assert recorder.parts() == [(0, 8), (8, 16)]  # the part under way when it was cancelled, no more


def test_a_part_that_fails_ends_its_request_and_the_others_go_on(model):
    def fail(engine):
        raise RuntimeError("out of memory")

    recorder = Recorder(model, hook=fail, at=5)  # calls: short, part 1, a decode, part 2, a decode, part 3
    short_params = SamplingParams(max_tokens=30, ignore_eos=True)
    out, reasons, _, _ = together(model, recorder, short_params)
    assert reasons == {"short": "length", "long0": "error: out of memory"}
    assert out["short"] == alone(model, SHORT, short_params)


def test_stopping_ends_a_prompt_being_prefilled_in_parts(model):
    engine = Engine(model, max_batch=4, max_len=128, prefill_chunk=CHUNK)
    reasons, parts = [], []

    def forward(ids, positions, *args, **kwargs):
        if ids.shape[1] > 1 and int(positions[0, 0]) == CHUNK:  # the long prompt's second part
            engine._pending.put(None)  # what stop() queues
        parts.append(ids.shape[1])
        return CausalLM.forward(model, ids, positions, *args, **kwargs)

    model.forward = forward
    try:
        engine.submit(SHORT, SamplingParams(max_tokens=30, ignore_eos=True), lambda t: None, reasons.append)
        engine.submit(LONG, SamplingParams(max_tokens=6, ignore_eos=True), lambda t: None, reasons.append)
        engine.start()
        engine._thread.join(60)
        assert not engine._thread.is_alive()
        assert sorted(reasons) == ["error: the engine stopped"] * 2
    finally:
        del model.forward
        engine.stop()


def test_a_speculating_engine_prefills_in_parts_too(tmp_path):
    from preload_cli.models import tiny_model
    from preload_daemon.arch import ArchSpec
    from worker.mtp import MTPDraft
    from worker.speculative import Speculator
    path = tiny_model("llama", tmp_path / "mtp-llama", mtp_layers=1, mtp_shared=True)
    main = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path))))
    draft = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path), component="draft")))
    spec = ArchSpec.from_config(main.config)
    lm, mtp = CausalLM(spec, main.tensors), MTPDraft(spec, {**main.tensors, **draft.tensors})
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = {tuple(p): alone(lm, p, params) for p in (SHORT, LONG)}
    engine = Engine(lm, max_batch=4, max_len=128, speculator=Speculator(mtp, 2), prefill_chunk=CHUNK)
    recorder = Recorder(lm)
    lm.forward, done = recorder, threading.Semaphore(0)
    try:
        requests = [engine.submit(p, params, lambda t: None, lambda r: done.release()) for p in (SHORT, LONG)]
        engine.start()
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        # the draft proposes from the main model's states of every part, joined (MTPDraftRunner.prefilled)
        assert [r.output for r in requests] == [expected[tuple(SHORT)], expected[tuple(LONG)]]
        assert recorder.parts()[:2] == [(0, 8), (8, 16)]
        assert engine.speculation()["proposed"] > 0
    finally:
        del lm.forward
        engine.stop()
