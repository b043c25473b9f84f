"""Data-parallel replicas behind one port. The router owns the port; each replica is a whole
engine (with its own TP ranks) listening on a Unix socket in a private directory, attached to the
same daemon slabs, so M replicas hold one copy of the weights. The router sends each request to the
ready replica with the fewest requests in flight, answers /ready and /metrics for all of them, and
restarts a replica that dies (warm: it attaches to the daemon again) while the others keep serving.

/ready is 200 with status "ready" when every replica is ready and "degraded" while at least one is
(the others restarting); 503 before the first start completes, or when none is ready. A replica
that dies is restarted after RESTART_DELAY_S, doubling up to MAX_RESTART_DELAY_S while its restarts
fail (their error shown in /ready); one that stops answering (stopped, hung) is out of rotation
until its health check answers again; once it has missed two in a row (about 15 s), the requests
it holds end (a 502, or a stream's error event). A request is sent to another replica only when
its own could not be connected to: one that reached a replica may have run there.

The router runs as its own lean process (`python -m worker.router SETTINGS_JSON`, which the engine
command execs into): it never imports torch, so it costs tens of MB, not an engine's hundreds.
"""

import asyncio
import json
import logging
import pathlib
import signal
import sys
import threading
import time

import anyio
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from worker.http_limits import BodyBudget, BodyRefused, BoundedH11, error, json_errors
from worker.replica import MAX_RESTART_DELAY_S, PROBE_EVERY_S, Replica, ReplicaStopped

log = logging.getLogger(__name__)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate"}
OWN_HEADERS = {"date", "server"}
"""A replica's answer keeps its headers but these, which the router's server sends itself (twice, a
Date header is invalid)."""


class Router:
    def __init__(self, num_replicas: int, socket_dir: pathlib.Path, command: list[str]):
        self.replicas = [Replica(i, socket_dir / f"replica-{i}.sock", command) for i in range(num_replicas)]
        self.failure = ""
        self.stopping, self.stopped = threading.Event(), threading.Event()

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()
        threading.Thread(target=self._supervise, name="replica-supervisor", daemon=True).start()
        threading.Thread(target=self._probe, name="replica-prober", daemon=True).start()

    def _supervise(self) -> None:
        """Restarts replicas that die after having been ready, each after its delay (doubled while
        its restarts fail); one that dies before its first readiness fails the whole engine (bad
        flags or a bad checkpoint fail every replica alike). The replicas it starts die with this
        thread (their parent-death signal), so it lasts until stop() has stopped them."""
        while not self.failure and not self.stopping.wait(0.2):
            for replica in self.replicas:
                if replica.proc.poll() is None:
                    continue
                code = replica.proc.returncode
                if not replica.ever_ready:
                    self.failure = f"replica {replica.index} exited with code {code} before it was ready: " \
                                   f"{replica.failure or 'see its log above'}"
                    log.error("%s", self.failure)
                    break
                if not replica.next_start:  # found dead just now
                    log.warning("replica %d (pid %d) exited with code %d%s; restarting it in %g s", replica.index,
                                replica.proc.pid, code, f" ({replica.failure})" if replica.failure else "",
                                replica.delay)
                    replica.restarts += 1
                    replica.next_start = time.monotonic() + replica.delay
                    replica.delay = min(2 * replica.delay, MAX_RESTART_DELAY_S)  # back to the first once ready
                elif time.monotonic() >= replica.next_start:
                    replica.next_start = 0.0
                    try:
                        replica.start()
                    except OSError as e:  # not even started: counted as a restart that failed
                        replica.failure = f"cannot start it: {e}"
        self.stopped.wait()

    def _probe(self) -> None:
        while not self.stopping.wait(PROBE_EVERY_S):
            for replica in self.replicas:
                replica.probe()

    def all_ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    def pick(self) -> Replica | None:
        ready = [r for r in self.replicas if r.ready]
        return min(ready, key=lambda r: r.in_flight) if ready else None

    def readiness(self) -> dict:
        num_ready = sum(r.ready for r in self.replicas)
        initial = all(r.ever_ready for r in self.replicas)
        status = "failed" if self.failure else "loading" if not initial else \
            "ready" if num_ready == len(self.replicas) else "degraded" if num_ready else "unavailable"
        body = {"status": status, "replicas_ready": num_ready, "dp_size": len(self.replicas),
                "replicas": [{"replica": r.index, "ready": r.ready, "restarts": r.restarts, "in_flight": r.in_flight,
                              "pid": r.proc.pid if r.proc else 0, **({"engine": r.ready_doc} if r.ready else {}),
                              **({"error": r.failure} if r.failure and not r.ready else {}),
                              **({"answering": False} if r.ready_doc and not r.reachable else {})}
                             for r in self.replicas]}
        if self.failure:
            body["reason"] = self.failure
        return body

    def stop(self) -> None:
        self.stopping.set()
        for replica in self.replicas:
            replica.stop()
        self.stopped.set()


def build_app(router: Router) -> Starlette:
    bodies = BodyBudget()  # a body is held until its answer ends (to send it to another replica, if one fails)

    async def health(_: Request):
        return JSONResponse({"status": "alive", "dp_size": len(router.replicas)})

    async def ready(_: Request):
        body = router.readiness()
        return JSONResponse(body, status_code=200 if body["status"] in ("ready", "degraded") else 503)

    async def metrics(_: Request):
        lines = merge_metrics(await asyncio.gather(*(_metrics_of(r) for r in router.replicas if r.ready)))
        lines += ["# TYPE preload_router_replicas_ready gauge",
                  f"preload_router_replicas_ready {sum(r.ready for r in router.replicas)}",
                  "# TYPE preload_router_replica_restarts_total counter"]
        lines += [f'preload_router_replica_restarts_total{{replica="{r.index}"}} {r.restarts}' for r in router.replicas]
        lines += ["# TYPE preload_router_request_body_bytes gauge", f"preload_router_request_body_bytes {bodies.held}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def proxy(request: Request):
        path = request.url.path
        if any(part in (".", "..") for part in path.split("/")):  # (the replicas' client would resolve them)
            return error(404, f"no such endpoint {path[:200]!r}: a path with . or .. segments", "not_found")
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in HOP_HEADERS]
        try:
            body = await bodies.read(request)
        except BodyRefused as e:
            return error(e.status, str(e), "invalid_request_error" if e.status in (400, 413) else "unavailable")
        try:
            return await forward(request, headers, body)
        except BaseException:
            bodies.release(len(body))
            raise

    async def forward(request: Request, headers: list, body: bytes):
        """The answer of the first replica reached; the body's budget is given back when it ends."""
        # Only a replica that could not be connected to is tried again with another: a request that
        # reached one may have run there (and one that makes replicas crash would crash them all).
        for _ in router.replicas:
            replica = router.pick()
            if replica is None:
                break
            try:
                upstream = replica.client.build_request(request.method, request.url.path,
                                                        params=request.query_params, headers=headers, content=body)
            except (httpx.InvalidURL, UnicodeError) as e:
                bodies.release(len(body))
                return error(400, f"the router cannot pass this request's path on ({e}); send a plain /v1/ path",
                             "invalid_request_error")
            generation = replica.generation
            replica.in_flight += 1
            try:
                response = await _send(request, replica, upstream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                replica.done(generation)
                replica.reachable = False
                log.warning("replica %d did not answer (%s); out of rotation until its health check answers",
                            replica.index, e)
                continue
            except (httpx.TransportError, ReplicaStopped) as e:
                replica.done(generation)
                replica.reachable = False
                bodies.release(len(body))
                log.warning("replica %d stopped before it answered a request (%s: %s)", replica.index,
                            type(e).__name__, e)
                return error(502, f"the engine replica serving this request stopped before it answered "
                                  f"({type(e).__name__}: {e}); send it again", "server_error")
            except BaseException:  # cancelled (the router stopping), or a bug: not counted against the replica
                replica.done(generation)
                raise
            if response is None:  # the client went away: the replica's request was closed, which ends it there
                replica.done(generation)
                bodies.release(len(body))
                return error(499, "the client closed the connection", "cancelled")
            return Relayed(replica, generation, response, lambda: bodies.release(len(body)))
        bodies.release(len(body))
        return error(503, "no engine replica is ready; retry shortly", "unavailable")

    routes = [Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
              Route("/v1/{path:path}", proxy, methods=["GET", "POST"])]
    return Starlette(exception_handlers={HTTPException: json_errors(routes, "router")}, routes=routes)


async def _send(request: Request, replica: Replica, upstream: httpx.Request) -> httpx.Response | None:
    """The replica's answer to `upstream` (its headers: a plain answer comes whole, once generated);
    None if the client went away first (closing the replica's request then ends the generation
    there, as a direct client's going away does). ReplicaStopped if the replica stops answering."""
    answer: list[httpx.Response] = []
    failed: list[Exception] = []

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tasks.cancel_scope.cancel()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(client_gone)
        try:
            answer.append(await replica.wait(replica.client.send(upstream, stream=True)))
        except Exception as e:  # raised as itself below, not in the task group's ExceptionGroup
            failed.append(e)
        finally:
            tasks.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return answer[0] if answer else None


class Relayed(StreamingResponse):
    """A replica's answer, passed on; its request counts against the replica until the answer ends,
    however it ends (the relay finished, broken off, or never begun: a client gone as its headers
    went out), and then `ended()` runs, once. A stream the replica breaks off (it died, or stopped
    answering its health checks) ends with an error event."""

    def __init__(self, replica: Replica, generation: int, response: httpx.Response, ended):
        self.replica, self.generation, self.upstream, self.ended = replica, generation, response, ended
        self.closed = False
        super().__init__(self._relay(), status_code=response.status_code,
                         headers={k: v for k, v in response.headers.items()
                                  if k.lower() not in HOP_HEADERS | OWN_HEADERS})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

    async def _relay(self):
        chunks, replica = self.upstream.aiter_raw(), self.replica
        try:
            while (chunk := await replica.wait(anext(chunks, None))) is not None:
                yield chunk
        except (httpx.HTTPError, ReplicaStopped) as e:
            log.warning("replica %d broke off an answer (%s: %s); out of rotation until its health check answers",
                        replica.index, type(e).__name__, e)
            if self.generation == replica.generation:  # (a dying replica's listener may still take a request)
                replica.reachable = False
            if not self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                raise  # the client's body ends short, so it can tell (a clean end would pass a cut body as whole)
            error = {"message": f"the engine replica serving this request stopped ({type(e).__name__}); send it "
                                "again", "type": "server_error", "code": 502}
            yield f"\n\ndata: {json.dumps({'error': error})}\n\n".encode()
        finally:
            await self._close()

    async def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.replica.done(self.generation)
        self.ended()
        with anyio.CancelScope(shield=True):  # a client gone: the task is cancelled, the response still closed
            await self.upstream.aclose()


def merge_metrics(texts: list[str]) -> list[str]:
    """The replicas' Prometheus texts as one: each family's HELP and TYPE once, then its samples
    from every replica (a family split in parts is not valid exposition format)."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP and TYPE, samples), first seen first
    for text in texts:
        family = ""
        for line in text.splitlines():
            comment = line.startswith(("# HELP ", "# TYPE "))
            if comment:
                family = (line.split(" ", 3) + [""])[2]
            elif not line or line.startswith("#"):
                continue
            meta, samples = families.setdefault(family, ([], []))
            if not comment:
                samples.append(line)
            elif line not in meta:
                meta.append(line)
    return [line for meta, samples in families.values() for line in meta + samples]


async def _metrics_of(replica: Replica) -> str:
    try:
        return (await replica.scraper.get("/metrics")).text
    except httpx.HTTPError:
        return ""


def run_router(num_replicas: int, socket_dir: pathlib.Path, command: list[str], *, host: str = "127.0.0.1",
               port: int = 8000) -> int:
    """Serves `num_replicas` engine replicas on host:port until SIGINT/SIGTERM; returns the exit code.
    Replica i runs `command` plus `--replica i --uds SOCKET` (an engine command with --dp-size 1)."""
    router = Router(num_replicas, socket_dir, command)
    server = uvicorn.Server(uvicorn.Config(build_app(router), host=host, port=port, log_level="warning",
                                           lifespan="off", http=BoundedH11, timeout_graceful_shutdown=30))
    outcome = {"code": 0}

    def announce() -> None:
        while not (router.all_ready() and server.started):
            if router.failure or server.should_exit:
                print(json.dumps({"event": "failed", "error": router.failure or "stopped"}), flush=True)
                outcome["code"] = 1
                server.should_exit = True
                return
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        print(json.dumps({"event": "ready", "port": bound, **router.readiness()}), flush=True)
        log.info("%d replicas ready behind port %d", num_replicas, bound)

    # uvicorn stops gracefully on SIGTERM, then raises the signal again; ours then stops the replicas
    # and lets main() remove the sockets (the default action would end the process first).
    signal.signal(signal.SIGTERM, _terminated)
    try:
        router.start()
        threading.Thread(target=announce, name="router-ready", daemon=True).start()
        server.run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the replicas' stop short
        router.stop()
    return outcome["code"]


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is."""


def _terminated(_signum: int, _frame) -> None:
    raise _Terminated


def main() -> int:
    """`python -m worker.router '{"replicas": M, "socket_dir": DIR, "command": [...], "host": H,
    "port": P, "log_level": L}'`: the router, with its socket directory removed on exit."""
    settings = json.loads(sys.argv[1])
    # Not preload_daemon.config.configure_logging: that would import grpc into this lean process.
    logging.basicConfig(level=settings.get("log_level", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe and per request otherwise
    socket_dir = pathlib.Path(settings["socket_dir"])
    code = None
    try:
        code = run_router(settings["replicas"], socket_dir, settings["command"], host=settings["host"],
                          port=settings["port"])
    except _Terminated:
        pass
    finally:
        for path in socket_dir.glob("replica-*.sock"):
            path.unlink(missing_ok=True)
        socket_dir.rmdir()
    if code is None:  # ended by SIGTERM, as a single engine is: the supervisor sees the signal, not a code
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return code


if __name__ == "__main__":
    sys.exit(main())
