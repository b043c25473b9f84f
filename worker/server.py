"""The engine's HTTP server (Starlette on uvicorn): /health, /ready, /metrics, /v1/models and
OpenAI-style /v1/completions, streaming or not."""

import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from preload_daemon.errors import InvalidRequestError
from worker.engine import SamplingParams
from worker.state import WorkerState


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_app(state: WorkerState) -> Starlette:
    async def health(_: Request):
        return JSONResponse(state.health())

    async def ready(_: Request):
        body = state.readiness()
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    async def metrics(_: Request):
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4")

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": state.name, "object": "model", "created": int(state.process_start), "owned_by": "preload",
             "weights_version": state.weights.version if state.weights else None}]})

    async def completions(request: Request):
        if not state.is_ready():
            return error(503, f"the engine is not ready: {state.not_ready_reason()}", "unavailable")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return error(400, f"bad JSON body: {e}")
        if body.get("model") not in (None, state.name):
            return error(404, f"model {body.get('model')!r} is not served here; this engine serves {state.name!r}",
                         "not_found_error")
        try:
            prompts = parse_prompts(body.get("prompt"), state)
            params = SamplingParams(max_tokens=int(body.get("max_tokens") or 16),
                                    temperature=float(body.get("temperature", 1.0)),
                                    top_p=float(body.get("top_p", 1.0)), seed=body.get("seed"),
                                    ignore_eos=bool(body.get("ignore_eos", False)))
            if int(body.get("n") or 1) != 1:
                raise InvalidRequestError("only n=1 is supported")
            stops = body.get("stop") or []
            stops = [stops] if isinstance(stops, str) else list(stops)
            run = Completion(state, prompts, params, stops)
        except (InvalidRequestError, TypeError, ValueError) as e:
            return error(400, str(e))
        if body.get("stream"):
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        return JSONResponse(await run.collect())

    return Starlette(routes=[
        Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
        Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def parse_prompts(prompt, state: WorkerState) -> list[list[int]]:
    """OpenAI accepts a string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(prompt, str):
        return [state.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [state.encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt) \
            and all(isinstance(t, int) for p in prompt for t in p):
        return prompt
    raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                              "of token ids")


class Completion:
    """One /v1/completions call: its prompts run as concurrent engine requests, and their tokens
    come back to the event loop through a queue."""

    def __init__(self, state: WorkerState, prompts: list[list[int]], params: SamplingParams, stops: list[str]):
        self.state = state
        self.prompts = prompts
        self.stops = stops
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.tokens = [[] for _ in prompts]
        self.sent = [""] * len(prompts)
        self.requests = [state.engine.submit(
            p, params, lambda t, i=i: self._put(i, "token", t), lambda r, i=i: self._put(i, "done", r))
            for i, p in enumerate(prompts)]

    def _put(self, index: int, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (index, kind, value))

    def _delta(self, index: int, final: bool) -> str:
        """New text of one choice since the last call. A trailing partial UTF-8 character waits for
        its next token; a stop string ends the choice there."""
        text = self.state.decode(self.tokens[index])
        for stop in self.stops:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
                self.requests[index].cancelled = True
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent[index] = text[len(self.sent[index]):], text
        return delta

    async def _events(self):
        remaining = len(self.prompts)
        while remaining:
            index, kind, value = await self.events.get()
            if kind == "token":
                self.tokens[index].append(value)
                if not self.requests[index].cancelled:
                    yield index, self._delta(index, False), None
            else:
                remaining -= 1
                reason = "stop" if self.requests[index].cancelled else value
                yield index, self._delta(index, True), reason

    async def collect(self) -> dict:
        texts, reasons = [""] * len(self.prompts), [None] * len(self.prompts)
        async for index, delta, reason in self._events():
            texts[index] += delta
            reasons[index] = reason or reasons[index]
        return {**self._envelope(), "choices": [
            {"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]} for i in range(len(texts))],
            "usage": self._usage()}

    async def stream(self):
        try:
            async for index, delta, reason in self._events():
                if delta or reason:
                    chunk = {**self._envelope(), "choices": [
                        {"index": index, "text": delta, "logprobs": None, "finish_reason": reason}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({**self._envelope(), 'choices': [], 'usage': self._usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for request in self.requests:  # the client went away: stop generating for it
                request.cancelled = True

    def _envelope(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.name}

    def _usage(self) -> dict:
        prompt = sum(map(len, self.prompts))
        completion = sum(map(len, self.tokens))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
