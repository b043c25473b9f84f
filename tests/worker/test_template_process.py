"""Chat templates render in a child process (worker/template_process.py): what the in-process bounds
cannot stop (a stuck call, many legal steps that add up to gigabytes) costs the child, which is
killed or fails, never the engine, and the next render gets a new child."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from preload_daemon.errors import CheckpointError
from tests.conftest import REPO, wait_until
from tests.worker.test_tokenizer_template import CHATML, USER, assert_one_line, checkpoint, render
from worker import template_process
from worker.template_process import RENDERER
from worker.tokenizer import Tokenizer

ONE_CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
# Each step is legal (a string under the 8 Mi bound, a list of 200 items), and together they hold
# 200 x 8 MB: 1.6 GB, which an in-process render would have taken from the engine.
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"  # hours
ADDS_UP = ("{% set ns = namespace(kept=[]) %}{% for i in range(200) %}"
           "{% set ns.kept = ns.kept + ['x' * 8000000 + i|string] %}{% endfor %}{{ ns.kept|length }}")


def child() -> psutil.Process:
    RENDERER.start()
    return psutil.Process(RENDERER._proc.pid)


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_memory_that_adds_up_fails_in_the_child_not_here(tmp_path):
    before = psutil.Process().memory_info().rss
    with pytest.raises(CheckpointError, match=r"chat template failed on these messages \(MemoryError") as e:
        render(tmp_path, ADDS_UP)
    assert_one_line(e)
    assert psutil.Process().memory_info().rss - before < 256 << 20
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)


def test_a_render_that_does_not_answer_is_killed_and_the_next_gets_a_new_child(tmp_path, monkeypatch):
    """The child's own deadline stops a template's loops; the kill is for what that deadline cannot
    reach (one long call). A negative margin makes the kill come first here."""
    monkeypatch.setattr(template_process, "KILL_MARGIN_S", -4.5)  # killed 0.5 s after it was sent
    first = child()
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"ran for more than 0.5 s on these messages and its renderer was "
                                              r"killed") as e:
        render(tmp_path, LOOPS)
    assert_one_line(e)
    assert time.monotonic() - started < 5
    assert gone(first)
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)
    assert RENDERER._proc.pid != first.pid


def test_a_child_that_died_between_renders_is_replaced(tmp_path):
    first = child()
    first.kill()
    wait_until(lambda: gone(first), what="the renderer to die")
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)
    assert RENDERER._proc.pid != first.pid


def test_a_child_that_dies_mid_render_fails_that_render_only(tmp_path):
    first = child()
    killer = threading.Timer(0.5, first.kill)  # as the OOM killer would
    killer.start()
    with pytest.raises(CheckpointError, match=r"renderer died on these messages \(killed by signal 9\)") as e:
        render(tmp_path, LOOPS)
    assert_one_line(e)
    assert render(tmp_path, CHATML).endswith(ONE_CHAT)


def test_renders_from_many_threads_take_turns(tmp_path):
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "model", CHATML))
    results, expected = [], tokenizer.chat_prompt(USER)

    def work() -> None:
        for _ in range(20):
            results.append(tokenizer.chat_prompt(USER))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [expected] * 80


def test_the_child_ends_with_its_parent_even_mid_render():
    script = ("import sys\nfrom worker import chat_template\nfrom worker.template_process import RENDERER\n"
              "chat_template.MAX_RENDER_SECONDS = 600\nRENDERER.start()\nprint(RENDERER._proc.pid, flush=True)\n"
              f"RENDERER.render({LOOPS!r}, 'a test', {{}})\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        renderer = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)  # rendering now
        assert not gone(renderer)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: gone(renderer), timeout=10, what="the orphaned renderer to exit")
    finally:
        parent.kill()
        parent.wait()


def test_messages_pass_through_unchanged(tmp_path):
    """The request travels as JSON: what JSON cannot hold as is (a lone surrogate, NUL, astral
    characters) reaches the template as the same str."""
    text = "a\x00b \ud800 \U0001f600 " + "é" * 1000
    messages = [{"role": "user", "content": text}]
    assert render(tmp_path, "{{ messages[0]['content'] }}", messages) == text
    assert os.getpid() != RENDERER._proc.pid
