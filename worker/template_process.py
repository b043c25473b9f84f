"""Chat templates rendered in a child process: what the in-process bounds of chat_template.py cannot
stop costs that child, not the engine.

Those bounds stop a template's own loops (a deadline traced on its lines) and any one value that
grows too big. They cannot stop work that runs inside one long call into C or a library (hashing or
comparing a huge nested literal, sorting 100,000 items), nor many legal steps that add up to
gigabytes. So each render runs in one long-lived child (`python -m worker.template_process`, which
imports Jinja and not torch: about 80 ms to start), whose address space is limited to MEMORY_LIMIT
and which is killed when a render has not answered KILL_MARGIN_S after its own deadline; the next
render starts a new one. The child renders one request at a time, in chat_template.py's sandbox,
with its bounds and its error messages; it exits when its parent does.

The parent side is one TemplateProcess per engine process (RENDERER), started at the first render
or by start(); the snapshot's quiet point stops it (a snapshot holds no child), and the first render
after a resume starts a new one. Frames on the child's stdin and stdout: a 4-byte big-endian length,
then JSON."""

import atexit
import json
import logging
import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time

from preload_daemon.errors import CheckpointError, InvalidRequestError, PreloadError
from worker import chat_template
from worker.template_bounds import MAX_PROMPT_CHARS

MEMORY_LIMIT = 1 << 30
"""The child's address space (RLIMIT_AS): a render that needs more fails with MemoryError."""
KILL_MARGIN_S = 2.0
"""The child's own deadline stops a template's loops after chat_template.MAX_RENDER_SECONDS with a
clear error; a render not answered this much later is stuck in one call, and the child is killed."""
MAX_FRAME = 8 * MAX_PROMPT_CHARS + (64 << 20)
"""Largest frame either side reads: a request (messages from a body of at most 64 MiB), or a
rendered prompt of at most MAX_PROMPT_CHARS characters, as UTF-8 JSON (control characters escaped
to 6 bytes)."""
log = logging.getLogger(__name__)
_LENGTH = struct.Struct(">I")
_FIX = "the template is broken or malicious: replace it with the model's published template"
_ERRORS = {"CheckpointError": CheckpointError, "InvalidRequestError": InvalidRequestError}


class TemplateProcess:
    """Renders chat templates in the child; one render at a time, from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts the child now rather than at the first render (which it would otherwise delay by
        about 80 ms); a failure is logged, and the first render reports it."""
        with self._lock:
            try:
                self._running()
            except PreloadError as e:
                log.warning("%s; chat requests will fail until it can start", e)

    def stop(self) -> None:
        with self._lock:
            self._kill()

    def render(self, source: str, origin: str, context: dict) -> str:
        """The template rendered on `context` (JSON values), or the PreloadError that says why not."""
        seconds = chat_template.MAX_RENDER_SECONDS  # read now: tests shorten it
        request = {"source": source, "origin": origin, "context": context, "seconds": seconds}
        kill_after = seconds + KILL_MARGIN_S
        with self._lock:
            proc = self._running()
            deadline = time.monotonic() + kill_after
            try:
                _write_frame(proc.stdin.fileno(), _encode(request), deadline)
                reply = _decode(_read_frame(proc.stdout.fileno(), deadline))
            except TimeoutError:
                self._kill()
                raise CheckpointError(f"{origin}: the chat template ran for more than {kill_after:g} s on these "
                                      f"messages and its renderer was killed (real ones take milliseconds); "
                                      f"{_FIX}") from None
            except (OSError, EOFError, ValueError) as e:
                how = self._kill(grace=1.0)
                raise CheckpointError(f"{origin}: the chat template's renderer died on these messages ({how or e}); "
                                      f"{_FIX}") from None
        if "text" in reply:
            return reply["text"]
        raise _ERRORS.get(reply.get("error"), CheckpointError)(reply.get("message", "the chat template failed"))

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()  # reaps one that died between renders
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "worker.template_process", str(os.getpid())],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        except OSError as e:
            raise PreloadError(f"cannot start the chat template's renderer process ({e})") from None
        os.set_blocking(self._proc.stdin.fileno(), False)
        return self._proc

    def _kill(self, grace: float = 0.0) -> str:
        """Ends the child if there is one, after `grace` seconds to end on its own (one that closed
        its output is dying); says how it ended, if it did so on its own."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        try:
            code = proc.wait(grace) if grace else proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        if code is None:
            return ""
        if code == 0:
            return "it exited"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


RENDERER = TemplateProcess()
atexit.register(RENDERER.stop)


def _encode(value) -> bytes:
    """JSON as UTF-8, a lone surrogate (which a str may hold) included: about the size of the request
    body it came from, where ASCII escapes could make it 6 to 12 bytes a character."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _decode(data: bytes):
    return json.loads(data.decode("utf-8", "surrogatepass"))


def _write_frame(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(_LENGTH.pack(len(data)) + data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            pass


def _read_frame(fd: int, deadline: float | None) -> bytes:
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size, deadline))
    if length > MAX_FRAME:
        raise ValueError(f"a {length}-byte frame (at most {MAX_FRAME})")
    return _read_exactly(fd, length, deadline)


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the renderer closed its output")
        out += chunk
    return bytes(out)


def _child(parent: int) -> None:
    """The child's loop: a request in, its answer out, until the parent goes."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    out = os.dup(1)
    os.dup2(2, 1)  # what a library prints goes to stderr, never into the frames

    def watch() -> None:  # a render stuck in one call would outlive the parent that was to kill it
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()
    templates: dict = {}  # compiled, by source: an engine has one, a test many
    while True:
        try:
            request = _decode(_read_frame(0, None))
        except EOFError:
            return
        try:
            template = templates.get(request["source"])
            if template is None:
                if len(templates) >= 8:
                    templates.clear()
                template = templates[request["source"]] = chat_template.compile_template(request["source"],
                                                                                         request["origin"])
            reply = {"text": chat_template.render_template(template, request["origin"], request["context"],
                                                           request["seconds"])}
        except PreloadError as e:
            reply = {"error": type(e).__name__, "message": str(e)}
        data = _encode(reply)
        os.write(out, _LENGTH.pack(len(data)))
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]


if __name__ == "__main__":
    _child(int(sys.argv[1]))
