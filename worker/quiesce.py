"""The engine's side of `preload snapshot`: reach a quiet point a process snapshot can be taken at,
and come back from it, in the original process or in a restored copy.

An engine keeps a wake pipe and an agent thread blocked on it. `preload snapshot` writes one JSON
line into the pipe through /proc/PID/fd/N (which only the engine's own user or root can open),
naming a control socket (worker/control.py) to connect to. Over that socket:

    snapshot: hello (who am I) -> quiesce -> quiet (canary, standard streams handed over)
    resume:   resume (standard streams, where to listen, the canary to match) -> ready | error

The quiet point: the HTTP server has drained and closed (no listening socket, no connection), the
scheduler is parked, the greedy canary has run alone, the chat template's renderer processes
(worker/template_process.py) have ended, the daemon session is closed (the lease ends) and every
slab mapping is an empty reservation (AttachedModel.suspend), the KV cache's pages are given back,
stdin/stdout/stderr are /dev/null, and the only thread that wakes is the agent's, blocked on the
pipe. A snapshot of the process then holds engine state only.

Resuming re-attaches the same weights at the same addresses (AttachedModel.resume: same key, digest
and layout, or the engine exits), re-runs the canary and compares it with the snapshot's, then
listens again. Any failure is reported on the control socket and ends the process: a restored
engine that cannot prove it has the same weights never serves.
"""

import ctypes
import gc
import json
import logging
import os
import pathlib
import socket
import sys
import threading
import time

import torch

import preload_daemon
from kernels import native
from preload_daemon.errors import DaemonUnavailableError
from worker import control, template_process
from worker.requests import SamplingParams

log = logging.getLogger(__name__)
CANARY_TOKENS = 2
"""A prefill and one decode step: every weight, the cache write and the decode attention path."""
CANARY_TEXT = "The capital of France is"
CANARY_PROMPT_TOKENS = 1
"""The canary's prompt is the first token of CANARY_TEXT: a one-row prefill multiplies on the GEMV
every decode step runs, while a longer prompt of one sequence meets torch's reference GEMM (about 4x
the time of the whole canary on CPUs without bfloat16 matrix units: it is on every restore's path)."""
LOGPROB_TOLERANCE = 1e-3
WAKE_LIMIT = 4096
DRAIN_SLACK_S = 10.0
"""Past --drain-timeout: the HTTP server's and the scheduler's drain together end within it
(`preload snapshot create` waits drain + 120 s for the quiet point, the canary included)."""
PARKED_LIMIT_S = 600.0
"""A quiet engine nobody resumes (the snapshot command died) resumes itself after this long parked."""
REATTACH_S = 60.0  # a resume's re-attaching while the daemon does not answer (a stopped one ended the engine)
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux


class Quiescer:
    """Owned by run_engine for a TP 1 engine. `server` is the running uvicorn server; run_engine
    calls `server_returned()` after it returns to know whether to serve again, and where."""

    def __init__(self, state, config, listen: dict):
        self.state, self.config = state, config
        self.listen = dict(listen)
        self.server = None
        self.host_pid = os.getpid()
        """This process as the host's kernel numbers it (differs in a restored copy's PID namespace)."""
        self._read, self._write = os.pipe()
        os.set_inheritable(self._write, False)
        self._stopped = threading.Event()
        """Set by run_engine when its server has returned."""
        self._next_listen: list | None = None
        self._listen_ready = threading.Event()
        self._quiet = False
        self._wakes = b""  # what the wake pipe gave past the last whole line taken
        self._pidns = ""
        self.problem = own_session() if not config.device.startswith("cuda:") else \
            "its weights are CUDA IPC memory, which cannot be parked at the same addresses: snapshots of GPU " \
            "engines are not supported yet"
        """Why this engine cannot be snapshotted ("" when it can): /ready says it, `create` refuses."""
        threading.Thread(target=self._agent, name="snapshot-agent", daemon=True).start()

    @property
    def wake_fd(self) -> int:
        return self._write

    # run_engine's side
    def server_returned(self) -> list | None:
        """Called when the HTTP server returned: the listening sockets to serve on next (the
        process waits here while quiet and a snapshot is taken), or None to exit."""
        self.server = None
        self._stopped.set()
        if not self._quiet and not self._listen_ready.is_set():
            return None  # a plain exit (SIGTERM, a failure): no snapshot going on
        self._listen_ready.wait()
        self._listen_ready.clear()
        sockets, self._next_listen = self._next_listen, None
        return sockets

    # the agent
    def _agent(self) -> None:
        while True:
            try:
                wake = self._wait_wake()
            except Exception as e:
                log.warning("snapshot agent: ignoring a bad wake message: %s", e)
                continue
            if wake is None:  # parked too long: the command that quieted us died
                if os.readlink("/proc/self/ns/pid") != self._pidns:  # a restored copy nobody woke
                    log.error("snapshot: restored, but never woken; exiting")
                    os._exit(1)
                self._resume({"op": "resume"}, [], conn=None)
                continue
            try:
                conn = control.connect(wake.get("control", ""), self._runtime_dir())
            except Exception as e:  # a bad path, a foreign socket, a runtime dir gone: the agent waits on
                log.warning("snapshot agent: cannot reach %r: %s", wake.get("control"), e)
                continue
            try:
                if wake.get("op") != "resume" and self._quiet:  # the identity would say ready: it served before
                    control.send(conn, {"error": "this engine is at a quiet point for another snapshot; try again "
                                                 "once it serves"})
                elif wake.get("op") != "resume":
                    self._snapshot(conn)
                elif not self._quiet:
                    control.send(conn, {"error": "this engine is not at a quiet point; nothing to resume"})
                else:
                    message, fds = control.receive(conn, 10.0)
                    self._resume(message, fds, conn)
            except Exception as e:
                log.warning("snapshot agent: %s: %s", type(e).__name__, e)
            finally:
                conn.close()

    def _wait_wake(self) -> dict | None:
        """The next wake message; None if parked (quiet) for PARKED_LIMIT_S. Parked time is summed
        over short waits, so that the clock jump of a restore does not count as time waited."""
        parked = 0.0
        while b"\n" not in self._wakes:  # two commands' lines may come in one read: each is taken in turn
            before = time.monotonic()
            # Only this thread changes _quiet: serving, the agent sleeps until a wake comes.
            if control.wait_readable(self._read, 1.0 if self._quiet else None):
                chunk = os.read(self._read, WAKE_LIMIT)
                self._wakes = (self._wakes + chunk)[-WAKE_LIMIT:]
            elif self._quiet:
                parked += min(time.monotonic() - before, 1.5)
                if parked > PARKED_LIMIT_S:
                    return None
        line, _, self._wakes = self._wakes.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("the wake message must be a JSON object")
        return message

    def _runtime_dir(self) -> pathlib.Path:
        from preload_daemon.config import default_runtime_dir
        return pathlib.Path(self.config.runtime_dir) if self.config.runtime_dir else default_runtime_dir()

    def identity(self) -> dict:
        """What a snapshot's manifest records of this engine, and what create checks."""
        state, config = self.state, self.config
        weights = state.weights
        attached = [w.attached for w in state.attachments()]
        return {
            "pid": os.getpid(), "host_pid": self.host_pid, "wake_fd": self.wake_fd, "tp_size": config.tp_size,
            "load_format": weights.load_format if weights else "", "device": config.device,
            "listen": self.listen, "runtime_dir": str(self._runtime_dir()),
            "model": {"name": config.name, "path": str(config.model), "version": weights.version if weights else 0,
                      "follows_active": config.weights_version == "active",
                      "weights_version_flag": config.weights_version,
                      "cache_key": attached[0].key.to_dict() if attached else {},
                      "content_digest": weights.content_digest if weights else "",
                      "weight_bytes": sum(s.size for a in attached for s in a.manifest.slabs),
                      "draft": [a.key.to_dict() for a in attached[1:]]},
            "speculative": config.speculative, "preload": preload_daemon.__version__,
            "python": sys.version.split()[0], "torch": torch.__version__, "kernels": native.VARIANT,
            "ready": state.is_ready(),
        }

    def _snapshot(self, conn) -> None:
        control.send(conn, {"hello": self.identity()})
        message, fds = control.receive(conn, 60.0)
        control._close(fds)
        if message.get("op") != "quiesce":
            return  # the command refused this engine, and said why on its side
        drain = float(message.get("drain_timeout", 30.0))
        timings = {"quiesce_start": time.time()}
        try:
            canary = self._quiesce(drain)
        except Exception as e:  # serve again as before, and tell the command why not
            reason = f"{type(e).__name__}: {e}"
            log.warning("snapshot: could not reach a quiet point: %s; serving on", reason)
            try:
                control.send(conn, {"error": reason})
            finally:  # the command gone too (an OSError): serve again all the same
                if self._quiet:
                    self._resume({"op": "resume"}, [], None)
            return
        timings["quiet"] = time.time()
        # The standard streams go to the command (the resume hands them back) and are /dev/null
        # here before it hears "quiet": the image holds no pipe or terminal of this session.
        sys.stdout.flush()
        sys.stderr.flush()
        streams = [os.dup(fd) for fd in (0, 1, 2)]
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        try:
            control.send(conn, {"quiet": {"canary": canary, "timings": timings}}, streams)
        except OSError as e:  # the command went away: nobody will take the snapshot
            log.warning("snapshot: the snapshot command went away (%s); serving on", e)
            self._resume({"op": "resume"}, streams, None)  # takes the streams back
            return
        control._close(streams)

    def _quiesce(self, drain: float) -> dict:
        """Drains and parks everything (module docstring); returns the canary run at the quiet point."""
        state = self.state
        if not state.is_ready():
            raise RuntimeError(f"the engine is not ready ({state.not_ready_reason()}); try again once it is")
        if self.problem:  # before anything drains
            raise RuntimeError(f"this engine cannot be snapshotted: {self.problem}")
        self._quiet, self._pidns = True, os.readlink("/proc/self/ns/pid")
        self._stopped.clear()
        deadline = time.monotonic() + drain + DRAIN_SLACK_S  # for the whole drain: the command waits longer
        self.server.config.timeout_graceful_shutdown = drain + 1.0  # then open requests are cancelled ...
        self.server.should_exit = True
        if not self._stopped.wait(drain):  # ... but they end before, each with a message to retry
            state.interrupt_generations("error: the engine is pausing for a snapshot; send the request again")
        if not self._stopped.wait(1.0 + DRAIN_SLACK_S):
            raise RuntimeError(f"the HTTP server did not drain within {drain + 1.0 + DRAIN_SLACK_S:g}s")
        engine = state.engine
        if not engine.pause(max(deadline - time.monotonic(), 1.0)):
            raise RuntimeError(f"requests still running after {drain:g}s of draining")
        canary = run_canary(engine, state.tokenizer)
        template_process.RENDERER.stop()  # and renders refused until the resume
        for keeper in state.keepers:
            keeper.stop(join=True)
        for attached in (w.attached for w in state.attachments()):
            attached.suspend()
        for cache in engine.caches():
            cache.drop_pages()
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        return canary

    def _resume(self, message: dict, fds: list[int], conn) -> None:
        """Back from the quiet point: streams, weights, canary, then the HTTP server (module docstring)."""
        timings = {"resume_start": time.time()}
        request_matrix_units()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        control._close(fds)
        from preload_daemon.client import DaemonClient  # protobuf: only once a snapshot is taken
        try:
            self.host_pid = int(message.get("host_pid") or self.host_pid)
            for attached in (w.attached for w in self.state.attachments()):
                if attached.suspended:  # each lease on a session of its own, as when it was first taken
                    self._reattach(attached, DaemonClient)
            timings["reattached"] = time.time()
            engine = self.state.engine
            if engine.parked:  # not when a quiet point was given up half way (requests still running)
                expected = message.get("canary")
                canary = run_canary(engine, self.state.tokenizer, expected)
                timings["canary"] = time.time()
                if expected is not None and (problem := canary_mismatch(expected, canary)):
                    raise RuntimeError(f"the canary differs after the restore: {problem}")
            engine.resume()
            template_process.RENDERER.resume()  # renders allowed again before the server listens
            for keeper in self.state.keepers:
                keeper.stop()
            self.state.keep_leases(self.config.device, self.config.runtime_dir)
            listen = message.get("listen") or {}
            host, port = str(listen.get("host", self.listen["host"])), int(listen.get("port", self.listen["port"]))
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
                sock = socket.create_server((host, port), family=family)
            except OSError as e:
                raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}; restore with --port P "
                                   "(0 picks a free one)") from None
            self.listen = {"host": host, "port": sock.getsockname()[1]}
            self._next_listen = [sock]
            self._listen_ready.set()  # before _quiet clears: server_returned reads them in that order
            self._quiet = False
            if not wait_started(lambda: self.server, 30.0):
                raise RuntimeError(f"the HTTP server did not start on {host}:{self.listen['port']}")
        except Exception as e:
            self._fail(conn, f"{type(e).__name__}: {e}")
            return
        timings["ready"] = time.time()
        if message.get("restore_start"):
            timings["restore_start"] = float(message["restore_start"])
        if message.get("snapshot"):  # a restored copy (the original resuming after a dump is not one)
            self.state.restored = {"snapshot": str(message["snapshot"]), **timings}
        body = {"event": "ready", "port": self.listen["port"], **self.state.readiness()}
        print(json.dumps(body), flush=True)
        if conn is not None:
            control.send(conn, {"ready": body, "timings": timings})
        if self.state.tokenizer is not None and self.state.tokenizer.has_chat_template:
            template_process.RENDERER.warm()  # after ready: not on the restore's path

    def _reattach(self, attached, client_class) -> None:
        """attached.resume on a new session, for REATTACH_S while the daemon does not answer."""
        deadline = time.monotonic() + REATTACH_S
        while True:
            try:
                attached.resume(client_class.for_device(self.config.device, self._runtime_dir(), timeout=10))
                return
            except DaemonUnavailableError as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("snapshot: the daemon does not answer (%s); trying again", e)
                time.sleep(1.0)

    def _fail(self, conn, reason: str) -> None:
        """Resuming failed: say why and end the process (it must not serve what it cannot vouch for)."""
        log.error("snapshot: %s; exiting", reason)
        print(json.dumps({"event": "failed", "error": reason}), flush=True)
        if conn is not None:
            try:
                control.send(conn, {"error": reason})
            except OSError:
                pass
        os._exit(1)


def request_matrix_units() -> bool:
    """Asks the kernel again for the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM), a
    permission a process holds, not a register CRIU restores: oneDNN asks for it before its first
    AMX matrix product, and a restored copy of an engine that had it would die of SIGILL on its
    first bfloat16 GEMM (a prefill of more rows than the GEMV takes). True where it was granted;
    False on CPUs without AMX (nothing to ask for) and off x86-64."""
    if os.uname().machine != "x86_64":
        return False
    return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def own_session() -> str:
    """CRIU dumps a process only along with its session leader, or (--shell-job) with one it can see
    in the process's PID namespace. An engine whose session leader is outside its PID namespace
    (some sandboxes and job runners start jobs like that) starts a session of its own where it can;
    returns why it cannot be snapshotted, or "". It does nothing for an engine whose session leader
    is visible (a shell's job keeps its terminal and Ctrl-C)."""
    if os.getsid(0) != 0:
        return ""
    try:
        os.setsid()
    except OSError as e:  # a process group leader cannot start a session
        return (f"its session leader is outside its PID namespace, which CRIU cannot dump, and it cannot start a "
                f"session of its own ({e.strerror}); start the engine under `setsid` to snapshot it")
    log.info("snapshot: started a session of our own (the session leader was outside our PID namespace)")
    return ""


def wait_started(server, timeout: float) -> bool:
    """Whether the HTTP server run_engine starts next (`server()` returns the current one) listens
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = server()
        if current is not None and current.started and current.servers:
            return True
        time.sleep(0.002)
    return False


def canary_prompt(tokenizer, vocab_size: int) -> list[int]:
    ids = tokenizer.encode(CANARY_TEXT) if tokenizer is not None else []
    return (ids or [17 % vocab_size])[:CANARY_PROMPT_TOKENS]


def run_canary(engine, tokenizer, like: dict | None = None) -> dict:
    """Greedy tokens and their log-probabilities for a fixed prompt (or `like`'s prompt and length:
    a snapshot's canary), run alone on the parked engine."""
    vocab = engine.model.spec.vocab_size
    prompt = canary_prompt(tokenizer, vocab)
    tokens = CANARY_TOKENS
    if like is not None:
        prompt = [int(t) for t in like.get("prompt_ids", [])][:64] or prompt
        tokens = min(max(len(like.get("tokens", [])), 1), 16)
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"the snapshot's canary prompt has token ids outside [0, {vocab})")
    result = engine.generate_parked(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0))
    return {"prompt_ids": prompt, "tokens": result.tokens, "logprobs": result.logprobs}


def canary_mismatch(expected: dict, got: dict) -> str:
    """Why two canaries differ ("" when they match: same tokens, log-probabilities within tolerance)."""
    if expected.get("prompt_ids") != got["prompt_ids"] or expected.get("tokens") != got["tokens"]:
        return f"tokens {got['tokens']} for {got['prompt_ids']}, expected {expected.get('tokens')} " \
               f"for {expected.get('prompt_ids')}"
    worst = max((abs(a - b) for a, b in zip(expected.get("logprobs", []), got["logprobs"])), default=0.0)
    if worst > LOGPROB_TOLERANCE or len(expected.get("logprobs", [])) != len(got["logprobs"]):
        return f"log-probabilities {got['logprobs']}, expected {expected.get('logprobs')}"
    return ""
