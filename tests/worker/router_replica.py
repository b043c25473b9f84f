"""A stand-in engine replica for the router's tests (tests/worker/test_router.py): a real process
serving HTTP on the Unix socket the router gives it (`--uds`), saying ready on stdout as an engine
replica does. POST /v1/completions with {"die_after_bytes": N} sends N bytes of a JSON answer and
then dies; {"delay_s": S} answers after S seconds, as an engine answers a whole completion.
SIGTERM is recorded in the file named by ROUTER_REPLICA_LOG before it exits."""

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


async def completions(request):
    body = json.loads(await request.body())
    if "die_after_bytes" in body:
        async def dying():
            yield b'{"choices": [{"text": "' + b"x" * body["die_after_bytes"]
            await asyncio.sleep(0.2)
            os._exit(9)
        return StreamingResponse(dying(), media_type="application/json")
    await asyncio.sleep(body.get("delay_s", 0))
    return JSONResponse({"replica": INDEX, "pid": os.getpid()})


def terminated(*_):
    with open(os.environ["ROUTER_REPLICA_LOG"], "a") as f:
        f.write(f"{INDEX} {os.getpid()} SIGTERM\n")
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
