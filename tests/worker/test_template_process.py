"""Chat templates render in child processes (worker/template_process.py): what the in-process
bounds cannot stop (a stuck call, many legal steps that add up to gigabytes) costs a child, which is
killed or fails, never the engine; the next render gets a new child, and one slow render holds up
one child, not every chat."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from preload_daemon.errors import CheckpointError
from tests.conftest import REPO, exited, wait_until
from tests.worker.test_tokenizer_template import CHATML, USER, assert_one_line, checkpoint, render
from worker import chat_template, template_process
from worker.template_process import RENDERER, RendererBusyError
from worker.tokenizer import Tokenizer

ONE_CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"  # hours
# Each step is legal (a string under the 8 Mi bound, a list of 200 items), and together they hold
# 200 x 8 MB: 1.6 GB, which an in-process render would have taken from the engine.
ADDS_UP = ("{% set ns = namespace(kept=[]) %}{% for i in range(200) %}"
           "{% set ns.kept = ns.kept + ['x' * 8000000 + i|string] %}{% endfor %}{{ ns.kept|length }}")


@pytest.fixture(autouse=True)
def one_child():
    """Each test starts with one idle renderer, seen among this process's children (in one CI run
    the next line found none)."""
    RENDERER.stop()
    RENDERER.resume()
    RENDERER.warm()
    wait_until(lambda: len(renderers()) == 1, what="the warmed renderer among this process's children")
    yield
    RENDERER.stop()
    RENDERER.resume()


def renderers(of: psutil.Process | None = None) -> list[psutil.Process]:
    return [c for c in (of or psutil.Process()).children() if "worker.template_process" in c.cmdline()
            and c.status() != psutil.STATUS_ZOMBIE]


def in_thread(function, *args) -> tuple[threading.Thread, list]:
    outcome = []

    def run():
        try:
            outcome.append(function(*args))
        except Exception as e:
            outcome.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_memory_that_adds_up_fails_in_the_child_not_here(tmp_path):
    before = psutil.Process().memory_info().rss
    with pytest.raises(CheckpointError, match=r"chat template failed on these messages \(MemoryError") as e:
        render(tmp_path, ADDS_UP)
    assert_one_line(e)
    assert psutil.Process().memory_info().rss - before < 256 << 20
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)


def test_a_render_that_does_not_answer_is_killed_and_the_next_gets_a_new_child(tmp_path, monkeypatch):
    """A child's own deadline stops a template's loops; the kill is for what that deadline cannot
    reach (one long call). A negative margin makes the kill come first here."""
    monkeypatch.setattr(template_process, "KILL_MARGIN_S", -4.5)  # killed 0.5 s after it was sent
    [first] = renderers()
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"did not finish within 0.5 s on these messages and its renderer "
                                              r"was killed") as e:
        render(tmp_path, LOOPS)
    assert_one_line(e)
    assert time.monotonic() - started < 5
    assert exited(first)
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)
    assert [c.pid for c in renderers()] != [first.pid]


def test_a_child_that_died_between_renders_is_replaced(tmp_path):
    """Found dead when taken (reaped), or when the request is written to it (not reaped yet)."""
    for wait in (True, False):
        [first] = renderers()
        first.kill()
        if wait:
            wait_until(lambda: exited(first), what="the renderer to die")
        assert render(tmp_path, CHATML).endswith(ONE_CHAT)
        assert first.pid not in [c.pid for c in renderers()]


def test_a_child_that_dies_mid_render_fails_that_render_only(tmp_path):
    [first] = renderers()
    killer = threading.Timer(0.5, first.kill)  # as the OOM killer would
    killer.start()
    with pytest.raises(CheckpointError, match=r"renderer died on these messages \(killed by signal 9\)") as e:
        render(tmp_path, LOOPS)
    assert_one_line(e)
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)


def test_a_child_that_does_not_take_the_request_is_not_the_templates_fault(tmp_path, monkeypatch):
    """A stopped or starved child never ran the template: a 503 to send it again, not a 500 that
    says to replace the template."""
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    monkeypatch.setattr(template_process, "KILL_MARGIN_S", 0.2)
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "model", CHATML))  # its template checked in the child
    [first] = renderers()
    first.suspend()  # SIGSTOP
    with pytest.raises(RendererBusyError, match="did not take the request within 0.5 s"):
        tokenizer.chat_prompt(USER)
    assert exited(first)
    assert tokenizer.chat_prompt(USER).endswith(ONE_CHAT)


def test_a_template_that_costs_too_much_to_compile_fails_the_load_in_a_child(tmp_path, monkeypatch):
    """A load compiles the template in a renderer (a syntax error fails the load): 1 MiB of nested
    expressions took the engine itself 29 s and 4.4 GB to compile, kept for good. The child is
    stopped at the render's deadline, and nothing compiled stays in this process."""
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    monkeypatch.setattr(template_process, "KILL_MARGIN_S", 0.2)
    [first] = renderers()
    source = "{{ " + "~".join(["a"] * 300_000) + " }}"
    compiled = []
    monkeypatch.setattr(chat_template, "compile_template", lambda *args: compiled.append(args))
    with pytest.raises(CheckpointError, match="the chat template did not finish within 0.5 s while it compiled "
                                              "and its renderer was killed") as e:
        Tokenizer.load(checkpoint(tmp_path / "model", source))
    assert_one_line(e)
    assert exited(first) and compiled == []


def test_pipes_grow_for_a_big_frame_and_shrink_back(tmp_path):
    """1 MiB while a frame over 64 KiB crosses, then 64 KiB again: the kernel counts pipe buffers
    against a per-user allowance, past which every new pipe of the user gets 8 KiB."""
    import fcntl
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "model", CHATML))
    big = [{"role": "user", "content": "x" * (1 << 20)}]
    assert len(tokenizer.chat_prompt(big)) > 1 << 20
    [child] = RENDERER._idle
    assert fcntl.fcntl(child.proc.stdin.fileno(), fcntl.F_GETPIPE_SZ) == 64 << 10
    tokenizer.chat_prompt(USER)  # the child sets its reply pipe back once the parent has read it
    assert [fcntl.fcntl(f.fileno(), fcntl.F_GETPIPE_SZ) for f in (child.proc.stdin, child.proc.stdout)] == \
        [64 << 10] * 2


def test_a_slow_render_holds_up_one_child_not_every_chat(tmp_path):
    """A legal but slow chat (here a template's loops, stopped at the 5 s deadline) once made every
    other chat request wait behind it."""
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "slow", LOOPS))
    fast = Tokenizer.load(checkpoint(tmp_path / "fast", CHATML))
    slow, outcome = in_thread(tokenizer.chat_prompt, USER)
    time.sleep(0.3)  # the slow render has its child
    assert fast.chat_prompt(USER).endswith(ONE_CHAT)
    assert slow.is_alive()  # answered while the slow one still ran
    slow.join(30)
    assert isinstance(outcome[0], CheckpointError) and "ran for more than 5 s" in str(outcome[0])


def test_requests_wait_for_a_free_child_a_bounded_time(tmp_path, monkeypatch):
    monkeypatch.setattr(template_process, "MAX_CHILDREN", 1)
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "slow", LOOPS))
    other = Tokenizer.load(checkpoint(tmp_path / "model", CHATML))
    slow, _ = in_thread(tokenizer.chat_prompt, USER)  # holds the only child up to 5 s
    time.sleep(0.3)
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)  # this request waits 0.3 + 2 s at most
    started = time.monotonic()
    with pytest.raises(RendererBusyError, match="all 1 chat template renderers stayed busy for 2.3 s"):
        other.chat_prompt(USER)
    assert time.monotonic() - started < 4.5
    slow.join(30)


def test_stop_ends_every_child_and_refuses_renders_until_resume(tmp_path, monkeypatch):
    """The snapshot's quiet point: a render running, and one waiting for a child, are refused (the
    waiting one once started a new child right after stop(), which the snapshot then held)."""
    monkeypatch.setattr(template_process, "MAX_CHILDREN", 1)
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "slow", LOOPS))
    running, ran = in_thread(tokenizer.chat_prompt, USER)
    time.sleep(0.3)
    waiting, waited = in_thread(tokenizer.chat_prompt, USER)
    time.sleep(0.3)
    RENDERER.stop()
    assert renderers() == []  # reaped, the busy one too, by the time stop() returns
    running.join(10)
    waiting.join(10)
    for outcome in (ran, waited):
        assert isinstance(outcome[0], RendererBusyError) and "pausing for a snapshot" in str(outcome[0]), outcome
    assert renderers() == []
    with pytest.raises(RendererBusyError):
        render(tmp_path, CHATML)
    RENDERER.warm()  # as the engine's start-up may, late: starts nothing while stopped
    assert renderers() == []
    RENDERER.resume()
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)


def test_renders_from_many_threads_take_turns(tmp_path):
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "model", CHATML))
    results, expected = [], tokenizer.chat_prompt(USER)

    def work() -> None:
        for _ in range(20):
            results.append(tokenizer.chat_prompt(USER))
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [expected] * 120
    assert 1 <= len(renderers()) <= template_process.MAX_CHILDREN


def test_the_child_ends_with_its_parent_even_mid_render():
    script = ("import psutil\nfrom worker import chat_template\nfrom worker.template_process import RENDERER\n"
              "chat_template.MAX_RENDER_SECONDS = 600\nRENDERER.warm()\n"
              "print(psutil.Process().children()[0].pid, flush=True)\n"
              f"RENDERER.render({LOOPS!r}, 'a test', {{}})\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        renderer = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)  # rendering now
        assert not exited(renderer)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: exited(renderer), timeout=10, what="the orphaned renderer to exit")
    finally:
        parent.kill()
        parent.wait()


def test_messages_pass_through_unchanged(tmp_path):
    """The request travels as JSON: what JSON cannot hold as is (a lone surrogate, NUL, astral
    characters) reaches the template as the same str."""
    text = "a\x00b \ud800 \U0001f600 " + "é" * 1000
    messages = [{"role": "user", "content": text}]
    assert render(tmp_path, "{{ messages[0]['content'] }}", messages) == text
    assert os.getpid() not in [c.pid for c in renderers()]
