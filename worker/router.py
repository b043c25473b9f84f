"""Data-parallel replicas behind one port. The router owns the port; each replica is a whole
engine (with its own TP ranks) listening on a Unix socket in a private directory, attached to the
same daemon slabs, so M replicas hold one copy of the weights. The router sends each request to the
ready replica with the fewest requests in flight, answers /ready and /metrics for all of them, and
restarts a replica that dies (warm: it attaches to the daemon again) while the others keep serving.

/ready is 200 with status "ready" when every replica is ready and "degraded" while at least one is
(the others restarting); 503 before the first start completes, or when none is ready.

The router runs as its own lean process (`python -m worker.router SETTINGS_JSON`, which the engine
command execs into): it never imports torch, so it costs tens of MB, not an engine's hundreds.
"""

import asyncio
import json
import logging
import pathlib
import subprocess
import sys
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from worker.http_limits import BoundedH11
from worker.procs import spawn_child

log = logging.getLogger(__name__)
RESTART_DELAY_S = 1.0
MAX_BODY_BYTES = 16 << 20  # a request body the router buffers (to retry it on another replica)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate"}


class Replica:
    def __init__(self, index: int, uds: pathlib.Path, command: list[str]):
        self.index, self.uds, self.command = index, uds, command
        self.proc: subprocess.Popen | None = None
        self.ready_doc: dict = {}
        self.failure = ""
        self.restarts = 0
        self.in_flight = 0
        self.ever_ready = False
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(uds)),
                                        base_url="http://replica", timeout=None)

    @property
    def ready(self) -> bool:
        return bool(self.ready_doc) and self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.uds.unlink(missing_ok=True)
        self.ready_doc, self.failure = {}, ""
        self.proc = spawn_child([*self.command, "--replica", str(self.index), "--uds", str(self.uds)],
                                stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_events, args=(self.proc,), name=f"replica-{self.index}",
                         daemon=True).start()

    def _read_events(self, proc: subprocess.Popen) -> None:
        """The replica's stdout carries its readiness line (and a failure line if it fails)."""
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "ready" and proc is self.proc:
                self.ready_doc, self.ever_ready = event, True
                log.info("replica %d ready (%s, pid %d)", self.index, event.get("load_format"), proc.pid)
            elif event.get("event") == "failed" and proc is self.proc:
                self.failure = event.get("error", "failed")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Router:
    def __init__(self, num_replicas: int, socket_dir: pathlib.Path, command: list[str]):
        self.replicas = [Replica(i, socket_dir / f"replica-{i}.sock", command) for i in range(num_replicas)]
        self.failure = ""
        self.stopping = threading.Event()

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()
        threading.Thread(target=self._supervise, name="replica-supervisor", daemon=True).start()

    def _supervise(self) -> None:
        """Restarts replicas that die after having been ready; one that dies before its first
        readiness fails the whole engine (bad flags or a bad checkpoint fail every replica alike)."""
        while not self.stopping.wait(0.2):
            for replica in self.replicas:
                if replica.proc.poll() is None:
                    continue
                code = replica.proc.returncode
                if not replica.ever_ready:
                    self.failure = f"replica {replica.index} exited with code {code} before it was ready: " \
                                   f"{replica.failure or 'see its log above'}"
                    log.error("%s", self.failure)
                    return
                log.warning("replica %d (pid %d) exited with code %d; restarting it", replica.index,
                            replica.proc.pid, code)
                replica.restarts += 1
                time.sleep(RESTART_DELAY_S)
                if not self.stopping.is_set():
                    replica.start()

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
                "replicas": [{"replica": r.index, "ready": r.ready, "restarts": r.restarts,
                              "pid": r.proc.pid if r.proc else 0, **({"engine": r.ready_doc} if r.ready else {})}
                             for r in self.replicas]}
        if self.failure:
            body["reason"] = self.failure
        return body

    def stop(self) -> None:
        self.stopping.set()
        for replica in self.replicas:
            replica.stop()


def build_app(router: Router) -> Starlette:
    async def health(_: Request):
        return JSONResponse({"status": "alive", "dp_size": len(router.replicas)})

    async def ready(_: Request):
        body = router.readiness()
        return JSONResponse(body, status_code=200 if body["status"] in ("ready", "degraded") else 503)

    async def metrics(_: Request):
        texts = await asyncio.gather(*(_metrics_of(r) for r in router.replicas if r.ready))
        seen, lines = set(), []
        for line in "".join(texts).splitlines():
            if line.startswith("# TYPE"):
                if line in seen:
                    continue
                seen.add(line)
            lines.append(line)
        lines += ["# TYPE preload_router_replicas_ready gauge",
                  f"preload_router_replicas_ready {sum(r.ready for r in router.replicas)}",
                  "# TYPE preload_router_replica_restarts_total counter"]
        lines += [f'preload_router_replica_restarts_total{{replica="{r.index}"}} {r.restarts}' for r in router.replicas]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def proxy(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return JSONResponse({"error": {"message": f"request body over {MAX_BODY_BYTES >> 20} MiB",
                                               "type": "invalid_request_error", "code": 413}}, status_code=413)
        # A replica that cannot be reached is taken out of rotation and the request goes to another:
        # nothing reached the engine, so trying again is safe.
        for _ in router.replicas:
            replica = router.pick()
            if replica is None:
                break
            upstream = replica.client.build_request(request.method, request.url.path, params=request.query_params,
                                                    headers=headers, content=bytes(body))
            replica.in_flight += 1
            try:
                response = await replica.client.send(upstream, stream=True)
            except httpx.TransportError as e:
                replica.in_flight -= 1
                replica.ready_doc = {}
                log.warning("replica %d did not answer (%s); taking it out of rotation", replica.index, e)
                continue
            return StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                     headers={k: v for k, v in response.headers.items()
                                              if k.lower() not in HOP_HEADERS},
                                     background=BackgroundTask(_finish, replica, response))
        return JSONResponse({"error": {"message": "no engine replica is ready; retry shortly", "type": "unavailable",
                                       "code": 503}}, status_code=503)

    return Starlette(routes=[
        Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
        Route("/v1/{path:path}", proxy, methods=["GET", "POST"])])


async def _finish(replica: Replica, response: httpx.Response) -> None:
    replica.in_flight -= 1
    await response.aclose()


async def _metrics_of(replica: Replica) -> str:
    try:
        return (await replica.client.get("/metrics", timeout=5)).text
    except httpx.HTTPError:
        return ""


def run_router(num_replicas: int, socket_dir: pathlib.Path, command: list[str], *, host: str = "127.0.0.1",
               port: int = 8000) -> int:
    """Serves `num_replicas` engine replicas on host:port until SIGINT/SIGTERM; returns the exit code.
    Replica i runs `command` plus `--replica i --uds SOCKET` (an engine command with --dp-size 1)."""
    router = Router(num_replicas, socket_dir, command)
    server = uvicorn.Server(uvicorn.Config(build_app(router), host=host, port=port, log_level="warning",
                                           lifespan="off", http=BoundedH11))
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

    router.start()
    threading.Thread(target=announce, name="router-ready", daemon=True).start()
    try:
        server.run()
    finally:
        router.stop()
    return outcome["code"]


def main() -> int:
    """`python -m worker.router '{"replicas": M, "socket_dir": DIR, "command": [...], "host": H,
    "port": P, "log_level": L}'`: the router, with its socket directory removed on exit."""
    settings = json.loads(sys.argv[1])
    # Not preload_daemon.config.configure_logging: that would import grpc into this lean process.
    logging.basicConfig(level=settings.get("log_level", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")
    socket_dir = pathlib.Path(settings["socket_dir"])
    try:
        return run_router(settings["replicas"], socket_dir, settings["command"], host=settings["host"],
                          port=settings["port"])
    finally:
        for path in socket_dir.glob("replica-*.sock"):
            path.unlink(missing_ok=True)
        socket_dir.rmdir()


if __name__ == "__main__":
    sys.exit(main())
