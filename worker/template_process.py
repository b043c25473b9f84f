"""Chat templates rendered in child processes: what the in-process bounds of chat_template.py cannot
stop costs a child, not the engine.

Those bounds stop a template's own loops (a deadline traced on its lines) and any one value that
grows too big. They cannot stop work that runs inside one long call into C or a library (hashing or
comparing a huge nested literal, sorting 100,000 items), nor many legal steps that add up to
gigabytes. So renders run in long-lived children (`python -m worker.template_process`, which import
Jinja and not torch: about 80 ms to start, 14 MiB), each limited to MEMORY_LIMIT of address space
and killed when a render has not answered KILL_MARGIN_S after its own deadline. A child renders one
request at a time, in chat_template.py's sandbox, with its bounds and its error messages, and exits
when its parent does.

The parent side is one TemplateProcess per engine process (RENDERER): a pool of at most
MAX_CHILDREN children, so that one slow render (a template's own loops, up to the 5 s deadline; a
chat of 65,536 one-character messages takes 1.3 s in ChatML) holds up one child, not every chat. A
request waits at most as long as a render may take for a free child, then gets RendererBusyError
(a 503). A tokenizer's load compiles its template in a child (check(): a template that does not
compile fails the load), which stays for the renders; warm() starts one where none runs (after a
snapshot's restore); the snapshot's quiet point stops them all (stop(), which holds until
resume(): a render that was waiting is refused rather than starting a child the snapshot would
hold). Frames on a child's stdin and stdout: a 4-byte big-endian length, then UTF-8 JSON."""

import atexit
import ctypes
import fcntl
import json
import logging
import os
import resource
import select
import struct
import subprocess
import sys
import termios
import threading
import time

from preload_daemon.errors import CheckpointError, InvalidRequestError, PreloadError
from worker import chat_template
from worker.template_bounds import MAX_PROMPT_CHARS

MAX_CHILDREN = 4
MEMORY_LIMIT = 1 << 30
"""A child's address space (RLIMIT_AS): a render that needs more fails with MemoryError."""
KILL_MARGIN_S = 2.0
"""A child's own deadline stops a template's loops after chat_template.MAX_RENDER_SECONDS (counted
from when it has the request) with a clear error; a render not answered this much later is stuck in
one call, and its child is killed."""
MAX_FRAME = 8 * MAX_PROMPT_CHARS + (64 << 20)
"""Largest frame either side reads: a request (messages of at most MAX_PROMPT_CHARS characters in
all, openai_api.parse_messages) or a rendered prompt, as UTF-8 JSON (control characters escaped to
6 bytes)."""
PIPE_BYTES = 1 << 20
"""A pipe's buffer while a frame over the default crosses it (64 KiB made a request of MiBs
thousands of writes, each a wait for the GIL behind the engine's other threads), and set back
after: the kernel counts pipe buffers against a per-user allowance (pipe-user-pages-soft, 64 MiB),
past which every new pipe of that user gets 8 KiB."""
DEFAULT_PIPE = 64 << 10
TRIM_AFTER = 16 << 20
"""A child hands the memory of a frame this big back to the system once it has answered."""
log = logging.getLogger(__name__)
_LENGTH = struct.Struct(">I")
_FIX = "the template is broken or malicious: replace it with the model's published template"
_ERRORS = {"CheckpointError": CheckpointError, "InvalidRequestError": InvalidRequestError}


class RendererBusyError(PreloadError):
    """No renderer was free in time, or the engine is pausing for a snapshot: try again."""


class TemplateProcess:
    """Renders chat templates in a pool of children, from any thread."""

    def __init__(self):
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._paused = False

    def warm(self) -> None:
        """Starts a child now rather than at the first render (which it would delay by about 80 ms),
        unless one runs or the pool is stopped; a failure is logged, and the first render reports it."""
        with self._cond:
            if not self._paused and not self._idle and not self._busy:
                try:
                    self._idle.append(_Child())
                except PreloadError as e:
                    log.warning("%s; chat requests will fail until it can start", e)

    def resume(self) -> None:
        """Lets renders run again after stop()."""
        with self._cond:
            self._paused = False

    def stop(self, wait: float = 5.0) -> None:
        """Ends every child, the busy ones too (their renders fail, and their threads reap them,
        which this waits for up to `wait` seconds), and refuses renders until resume()."""
        with self._cond:
            self._paused = True
            for child in self._idle:
                child.kill()
            self._idle.clear()
            for child in self._busy:
                child.signal_kill()
            self._cond.notify_all()
            deadline = time.monotonic() + wait
            while self._busy and deadline > time.monotonic():
                self._cond.wait(deadline - time.monotonic())
            if self._busy:
                log.warning("%d chat template renderers were not reaped within %g s", len(self._busy), wait)

    def render(self, source: str, origin: str, context: dict) -> str:
        """The template rendered on `context` (JSON values), or the PreloadError that says why not."""
        return self._run(source, origin, {"context": context}, "on these messages")

    def check(self, source: str, origin: str) -> None:
        """Compiles the template in a child, as a load checks it (a syntax error fails the load, not
        a request): a template of 1 MiB of nested expressions took the engine 29 s and 4.4 GB to
        compile, kept for good. The child stays, for the first render."""
        self._run(source, origin, {"check": True}, "while it compiled")

    def _run(self, source: str, origin: str, fields: dict, doing: str) -> str:
        seconds = chat_template.MAX_RENDER_SECONDS  # read now: tests shorten it
        request = _encode({"source": source, "origin": origin, "seconds": seconds, **fields})
        for attempt in (1, 2):
            child = self._acquire(seconds + KILL_MARGIN_S)
            try:
                reply = child.render(request, seconds + KILL_MARGIN_S, origin, doing)
                break
            except _DiedUnread:  # before it read the request: not this request's doing
                if attempt == 2:
                    raise CheckpointError(f"{origin}: the chat template's renderer died before it could render "
                                          "these messages, twice; see the engine's log") from None
            except CheckpointError:
                if self._paused:
                    raise _pausing() from None
                raise
            finally:
                self._release(child)
        if "text" in reply:
            return reply["text"]
        raise _ERRORS.get(reply.get("error"), CheckpointError)(reply.get("message", "the chat template failed"))

    def _acquire(self, wait: float) -> "_Child":
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if self._paused:
                    raise _pausing()
                while self._idle:
                    child = self._idle.pop()
                    if child.alive():
                        self._busy.add(child)
                        return child
                    child.kill()  # died between renders: reaped here
                if len(self._busy) < MAX_CHILDREN:
                    child = _Child()
                    self._busy.add(child)
                    return child
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendererBusyError(f"all {MAX_CHILDREN} chat template renderers stayed busy for {wait:g} s; "
                                            "send the request again")
                self._cond.wait(left)

    def _release(self, child: "_Child") -> None:
        with self._cond:
            self._busy.discard(child)
            if child.alive() and not self._paused:
                self._idle.append(child)
            else:
                child.kill()
            self._cond.notify()


class _DiedUnread(Exception):
    """The child died before it read the whole request: not that request's doing."""


class _Child:
    """One renderer process; used by one thread at a time."""

    def __init__(self):
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker.template_process", str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        except OSError as e:
            raise PreloadError(f"cannot start a chat template renderer process ({e})") from None
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.dead = False

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def signal_kill(self) -> None:
        """From any thread: the thread rendering on this child finds it dead, reaps it and closes
        its pipes (closing them here could close descriptor numbers that thread reuses)."""
        self.proc.kill()

    def render(self, request: bytes, within: float, origin: str, doing: str) -> dict:
        """Sends the request and reads the reply; the reply must come `within` seconds of the child
        having the request (the write has its own such deadline). Kills the child on any failure."""
        fd, big = self.proc.stdin.fileno(), len(request) > DEFAULT_PIPE
        try:
            if big:
                _resize(fd, PIPE_BYTES)
            try:
                _write_frame(fd, request, time.monotonic() + within)
            except BrokenPipeError:
                raise _DiedUnread() from None
            except TimeoutError:
                raise _stalled(within) from None
            except OSError as e:
                raise self._failed(origin, e, within, doing) from None
            try:
                reply = _decode(_read_frame(self.proc.stdout.fileno(), time.monotonic() + within))
            except (OSError, EOFError, TimeoutError, ValueError) as e:
                if _unread(fd):  # it never had all of the request: the template did not run
                    raise (_stalled(within) if isinstance(e, TimeoutError) else _DiedUnread()) from None
                raise self._failed(origin, e, within, doing) from None
            if big:
                _resize(fd, DEFAULT_PIPE)  # empty: the child read it all
            return reply
        except BaseException:
            self.kill(grace=1.0)  # whatever went wrong (a MemoryError here too), no reply is half read
            raise

    def _failed(self, origin: str, error: Exception, within: float, doing: str) -> CheckpointError:
        if isinstance(error, TimeoutError):
            self.kill()
            return CheckpointError(f"{origin}: the chat template did not finish within {within:g} s {doing} "
                                   f"and its renderer was killed (real ones take milliseconds); {_FIX}")
        how = self.kill(grace=1.0)
        return CheckpointError(f"{origin}: the chat template's renderer died {doing} ({how or error}); {_FIX}")

    def kill(self, grace: float = 0.0) -> str:
        """Ends the child, after `grace` seconds to end on its own (one that closed its output is
        dying), reaps it and closes its pipes; says how it ended, if it did so on its own. Only by
        the thread that holds the child (or the pool, for an idle one); idempotent."""
        if self.dead:
            return ""
        self.dead = True
        try:
            code = self.proc.wait(grace) if grace else self.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
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


def _pausing() -> RendererBusyError:
    return RendererBusyError("the engine is pausing for a snapshot; send the request again")


def _stalled(within: float) -> RendererBusyError:
    return RendererBusyError(f"a chat template renderer did not take the request within {within:g} s (is the host "
                             "overloaded?); send it again")


def _resize(fd: int, size: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except OSError:  # over pipe-max-size or the user's allowance: the default works, slower
        pass


def _unread(fd: int) -> int:
    """Bytes written into a pipe that its reader has not taken."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


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
    raised = False  # the reply pipe, for a reply over its default size
    while True:
        try:
            frame = _read_frame(0, None)
        except EOFError:
            return
        if raised:  # the parent read the last reply before it sent this request
            _resize(out, DEFAULT_PIPE)
            raised = False
        request = _decode(frame)
        spent = False  # memory exhausted: this child answers, then ends
        try:
            template = templates.get(request["source"])
            if template is None:
                if len(templates) >= 8:
                    templates.clear()
                template = templates[request["source"]] = _compile(request["source"], request["origin"])
            reply = {"text": "" if request.get("check") else chat_template.render_template(
                template, request["origin"], request["context"], request["seconds"])}
        except PreloadError as e:
            reply = {"error": type(e).__name__, "message": str(e)}
            spent = isinstance(e.__cause__, MemoryError)
        data = _encode(reply)
        if len(data) > DEFAULT_PIPE:
            _resize(out, PIPE_BYTES)
            raised = True
        os.write(out, _LENGTH.pack(len(data)))
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
        if spent:
            os._exit(0)
        if len(frame) + len(data) > TRIM_AFTER:  # else the child keeps the peak of its largest render
            del frame, request, reply, data, view
            ctypes.CDLL(None).malloc_trim(0)


def _compile(source: str, origin: str):
    """chat_template.compile_template, where a template too big for the child's memory, or nested
    too deeply for Python's stack, is the template's fault too."""
    try:
        return chat_template.compile_template(source, origin)
    except (MemoryError, RecursionError) as e:
        raise CheckpointError(f"{origin}: the chat template is too large or nested too deeply to compile "
                              f"({type(e).__name__}, in a renderer of {MEMORY_LIMIT >> 20} MiB); {_FIX}") from e


if __name__ == "__main__":
    try:
        _child(int(sys.argv[1]))
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches the engine's whole group: its parent says so
        sys.exit(130)
