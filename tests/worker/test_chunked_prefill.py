"""A long prompt that arrives while others decode is prefilled in parts, a decode step of the others
between its parts: what each request gets is what it gets alone (float32), and a part-prefilled
request that is cancelled, fails, or is caught by the engine stopping or parking ends cleanly.
Prompts that arrive together on an idle engine are prefilled whole, as before."""

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
LONG_PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama):
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(tiny_llama))))
    return CausalLM.from_config(weights.config, weights.tensors)


class Recorder:
    """Wraps a model's forward: records (rows, first position, last position + 1) of each call, and
    runs `hook(engine)` before the call made with index `at`."""

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


def alone(model, prompt, params, speculator=None):
    engine = Engine(model, max_batch=4, max_len=128, prefill_chunk=0, speculator=speculator).start()
    try:
        return engine.generate(prompt, params).tokens, dict(engine.stats)
    finally:
        engine.stop()


def together(model, recorder, short_params, long_n=1, chunk=CHUNK, speculator=None, at_once=False,
             settle=lambda engine: None):
    """The short request runs (its first token holds the scheduler until then), and the long one
    arrives while it decodes; with `at_once`, both are queued before the scheduler starts.
    `settle(engine)` runs once both have ended, before the engine stops."""
    engine = Engine(model, max_batch=4, max_len=128, prefill_chunk=chunk, speculator=speculator)
    model.forward, recorder.engine = recorder, engine
    out, reasons, done = {"short": [], "long": [[] for _ in range(long_n)]}, {}, threading.Semaphore(0)
    first, go = threading.Event(), threading.Event()

    def finished(key):
        return lambda reason: (reasons.__setitem__(key, reason), done.release())

    def short_token(token):
        out["short"].append(token)
        if len(out["short"]) == 1:
            first.set()
            assert go.wait(60)

    try:
        if at_once:
            go.set()
        else:
            engine.start()
        engine.submit(SHORT, short_params, short_token, finished("short"))
        if not at_once:
            assert first.wait(60)
        longs = engine.submit_choices(LONG, [LONG_PARAMS] * long_n, [t.append for t in out["long"]],
                                      [finished(f"long{i}") for i in range(long_n)])
        if at_once:
            engine.start()
        go.set()
        for _ in range(1 + long_n):
            assert done.acquire(timeout=60)
        settle(engine)
        assert sorted(engine._free) == [0, 1, 2, 3] and not engine._filling and not engine._running
        return out, reasons, longs, engine
    finally:
        del model.forward
        engine.stop()


def test_a_long_prompt_is_prefilled_in_parts_between_decode_steps_and_both_answers_are_unchanged(model):
    short_params = SamplingParams(max_tokens=30, ignore_eos=True)
    recorder = Recorder(model)
    out, reasons, _, engine = together(model, recorder, short_params)
    assert recorder.parts() == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert recorder.decodes_between_parts() == [1, 1, 1, 1], recorder.calls
    assert reasons == {"short": "length", "long0": "length"}
    assert out["short"] == alone(model, SHORT, short_params)[0]
    assert out["long"][0] == alone(model, LONG, LONG_PARAMS)[0]
    assert engine.stats["prompt_tokens"] == len(SHORT) + len(LONG) and engine.stats["prefill_parts"] == 5


def test_prompts_that_arrive_together_on_an_idle_engine_are_prefilled_whole(model):
    """Only prompts that find others decoding go in parts: a batch of prompts of several lengths
    on an idle engine keeps its whole prefills (the longer ones were cut up behind the shortest)."""
    recorder = Recorder(model)
    together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True), at_once=True)
    assert recorder.parts() == [(0, 40)] and recorder.calls[:2] == [(1, 0, len(SHORT)), (1, 0, len(LONG))]


def test_the_rest_of_a_prompt_goes_whole_once_nothing_else_runs(model):
    recorder = Recorder(model)
    out, reasons, _, _ = together(model, recorder, SamplingParams(max_tokens=3, ignore_eos=True))
    assert recorder.parts() == [(0, 8), (8, 40)]  # the short request ended after the first part
    assert out["long"][0] == alone(model, LONG, LONG_PARAMS)[0]


def test_choices_of_a_prompt_prefilled_in_parts_copy_its_cache(model):
    recorder = Recorder(model)
    out, reasons, _, _ = together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True), long_n=2)
    expected = alone(model, LONG, LONG_PARAMS)[0]
    assert out["long"] == [expected, expected] and len(recorder.parts()) == 5


def test_one_choice_cancelled_while_its_prompt_is_in_parts_leaves_the_other_going(model):
    def cancel(engine):  # one client of two goes away while the second part runs
        engine._filling[0].siblings[0].cancelled = True

    recorder = Recorder(model, hook=cancel, at=4)  # calls: short, a decode, part 1, a decode, part 2
    out, reasons, _, _ = together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True), long_n=2)
    assert reasons["long0"] == "length" and out["long"][0] == alone(model, LONG, LONG_PARAMS)[0]
    assert reasons["long1"] == "stop" and out["long"][1] == [] and len(recorder.parts()) == 5


def test_chunking_off_prefills_whole(model):
    recorder = Recorder(model)
    together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True), chunk=0)
    assert recorder.parts() == [(0, 40)]


def test_a_cancelled_prompt_stops_being_prefilled_and_gives_back_its_slot(model):
    def cancel(engine):  # the client goes away while the second part runs
        engine._filling[0].cancelled = True

    recorder = Recorder(model, hook=cancel, at=4)
    out, reasons, _, engine = together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True))
    assert reasons == {"short": "length", "long0": "stop"} and out["long"] == [[]]
    assert recorder.parts() == [(0, 8), (8, 16)]  # the part under way when it was cancelled, no more
    assert engine.stats["prompt_tokens"] == len(SHORT) + 16  # what was prefilled, not the whole prompt


def test_a_part_that_fails_ends_its_request_and_the_others_go_on(model):
    def fail(engine):
        raise RuntimeError("out of memory")

    recorder = Recorder(model, hook=fail, at=6)  # the long prompt's third part
    short_params = SamplingParams(max_tokens=30, ignore_eos=True)
    out, reasons, _, _ = together(model, recorder, short_params)
    assert reasons == {"short": "length", "long0": "error: out of memory"}
    assert out["short"] == alone(model, SHORT, short_params)[0]


def test_parking_waits_for_a_prompt_being_prefilled_in_parts(model):
    """A snapshot's quiet point: pause() parks once what runs has finished, the prompt in parts too."""
    parked = []

    def pause(engine):
        threading.Thread(target=lambda: parked.append(engine.pause(60))).start()

    def settle(engine):  # the scheduler parks once both have ended (and stop() would resume it)
        assert engine._parked.wait(60) and not engine._filling and not engine._running

    recorder = Recorder(model, hook=pause, at=2)  # as the first part starts
    out, reasons, _, engine = together(model, recorder, SamplingParams(max_tokens=30, ignore_eos=True),
                                       settle=settle)
    assert reasons == {"short": "length", "long0": "length"} and len(recorder.parts()) == 5
    assert out["long"][0] == alone(model, LONG, LONG_PARAMS)[0] and parked == [True]


def test_stopping_ends_a_prompt_being_prefilled_in_parts(model):
    reasons = []

    def stop(engine):
        engine._pending.put(None)  # what stop() queues

    recorder = Recorder(model, hook=stop, at=4)
    engine = Engine(model, max_batch=4, max_len=128, prefill_chunk=CHUNK).start()
    model.forward, recorder.engine = recorder, engine
    first, go = threading.Event(), threading.Event()
    try:
        engine.submit(SHORT, SamplingParams(max_tokens=30, ignore_eos=True),
                      lambda t: (first.set(), go.wait(60)), reasons.append)
        assert first.wait(60)
        engine.submit(LONG, LONG_PARAMS, lambda t: None, reasons.append)
        go.set()
        engine._thread.join(60)
        assert not engine._thread.is_alive()
        assert sorted(reasons) == ["error: the engine stopped"] * 2 and recorder.parts() == [(0, 8), (8, 16)]
    finally:
        del model.forward
        engine.stop()


def test_a_speculating_engine_prefills_in_parts_too(tmp_path, monkeypatch):
    """With an MTP draft, the main model's states of every part are joined for it: what it proposes
    for the long prompt, step by step, is what it proposes after a whole prefill (its greedy tokens
    alone would not show it: they are the main model's whatever the draft proposes)."""
    from preload_cli.models import tiny_model
    from preload_daemon.arch import ArchSpec
    from worker.mtp import MTPDraft
    from worker.speculative import MTPDraftRunner, Speculator
    path = tiny_model("llama", tmp_path / "mtp-llama", mtp_layers=1, mtp_shared=True)
    main = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path))))
    draft = load_safetensors(LoadRequest(spec=LoadSpec(path=str(path), component="draft")))
    spec = ArchSpec.from_config(main.config)
    lm, mtp = CausalLM(spec, main.tensors), MTPDraft(spec, {**main.tensors, **draft.tensors})
    proposals = []
    real = MTPDraftRunner.propose

    def propose(self, slot, tokens, k, pick):
        proposal = real(self, slot, tokens, k, pick)
        if tokens[:len(LONG)] == LONG:
            proposals.append((len(tokens), proposal.tokens))
        return proposal

    monkeypatch.setattr(MTPDraftRunner, "propose", propose)
    short_params = SamplingParams(max_tokens=30, ignore_eos=True)
    long_alone = alone(lm, LONG, LONG_PARAMS, Speculator(mtp, 2))[0]
    whole, proposals[:] = list(proposals), []
    recorder = Recorder(lm)
    out, reasons, longs, engine = together(lm, recorder, short_params, speculator=Speculator(mtp, 2))
    assert out["long"][0] == long_alone and out["short"] == alone(lm, SHORT, short_params)[0]
    assert recorder.parts()[:2] == [(0, 8), (8, 16)]
    assert len(whole) > 1 and proposals == whole
