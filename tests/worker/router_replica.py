"""A stand-in engine replica for the router's tests (tests/worker/test_router.py): a real process
serving HTTP on the Unix socket the router gives it (`--uds`), saying ready on stdout as an engine
replica does. POST /v1/completions with {"die_after_bytes": N} sends N bytes of a JSON answer and
then dies; {"die": true} dies before it answers; {"delay_s": S} answers after S seconds, as an
engine answers a whole completion (a client gone first is recorded: "INDEX gone"); {"chunks": N}
streams N server-sent events a tenth of a second apart. Every request is recorded ("INDEX got"),
and so is SIGTERM, in the file named by ROUTER_REPLICA_LOG."""

import asyncio
import contextlib
import json
import os
import signal
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

INDEX = int(sys.argv[sys.argv.index("--replica") + 1])


async def ready(_):
    return JSONResponse({"status": "ready"})


async def metrics(_):
    return PlainTextResponse(f'# HELP m M.\n# TYPE m gauge\nm{{replica="{INDEX}"}} 1\n')


def record(what: str) -> None:
    with open(os.environ["ROUTER_REPLICA_LOG"], "a") as f:
        f.write(f"{INDEX} {what}\n")


async def completions(request):
    body = json.loads(await request.body())
    record("got")
    if body.get("die"):
        os._exit(9)
    if "chunks" in body:
        async def events():
            for i in range(body["chunks"]):
                yield f"data: {json.dumps({'chunk': i})}\n\n".encode()
                await asyncio.sleep(0.1)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    if "die_after_bytes" in body:
        async def dying():
            yield b'{"choices": [{"text": "' + b"x" * body["die_after_bytes"]
            await asyncio.sleep(0.2)
            os._exit(9)
        return StreamingResponse(dying(), media_type="application/json")
    if body.get("delay_s"):
        async def client_gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            record("gone")
        watcher = asyncio.ensure_future(client_gone())
        await asyncio.wait([watcher], timeout=body["delay_s"])
        watcher.cancel()
    return JSONResponse({"replica": INDEX, "pid": os.getpid(), "headers": dict(request.headers)})


def terminated(*_):
    record(f"{os.getpid()} SIGTERM")
    os._exit(0)


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        signal.signal(signal.SIGTERM, terminated)
        yield

    async def startup(self, sockets=None):
        await super().startup(sockets)
        print(json.dumps({"event": "ready", "load_format": "stand-in", "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    app = Starlette(routes=[Route("/ready", ready), Route("/metrics", metrics),
                            Route("/v1/completions", completions, methods=["POST"])])
    Server(uvicorn.Config(app, uds=sys.argv[sys.argv.index("--uds") + 1], log_level="warning", lifespan="off")).run()
