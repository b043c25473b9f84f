"""The engine's HTTP server (Starlette on uvicorn): /health, /ready, /metrics, /v1/models and the
OpenAI-style /v1/completions and /v1/chat/completions, streaming or not (fields: openai_api.py)."""

import asyncio
import dataclasses
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from preload_daemon.errors import InvalidRequestError, PreloadError
from worker.http_limits import BodyBudget, BodyRefused, error, json_errors
from worker.openai_api import Options, parse_messages, parse_options
from worker.requests import SamplingParams
from worker.sampling import Pick
from worker.state import WorkerState
from worker.template_bounds import MAX_PROMPT_CHARS
from worker.template_process import RendererBusyError
from worker.tokenizer import IncrementalText

MAX_CHOICES = 4096
"""Choices (prompts x n) one request may ask for: each is set up on the event loop (800,000 of them
held it 13 s, and 600 MB)."""


def build_app(state: WorkerState) -> Starlette:
    bodies = BodyBudget()

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

    async def generate(request: Request, chat: bool):
        if not state.is_ready():
            return error(503, f"the engine is not ready: {state.not_ready_reason()}", "unavailable")
        try:
            raw = await bodies.read(request)
        except BodyRefused as e:
            return error(e.status, str(e), "invalid_request_error" if e.status in (400, 413) else "unavailable")
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return error(400, f"bad JSON body: {e}")
        except RecursionError:
            return error(400, "bad JSON body: nested too deeply (arrays or objects thousands of levels deep)")
        finally:
            bodies.release(len(raw))
            del raw
        if body.get("model") not in (None, state.name):
            return error(404, f"model {body.get('model')!r} is not served here; this engine serves {state.name!r}",
                         "not_found_error")

        def prepare():  # the template and the tokenizer may take seconds: not on the event loop
            options = parse_options(body, chat=chat)
            if chat:
                prompts, texts = [state.encode(state.chat_prompt(parse_messages(body.get("messages"))))], [None]
            else:
                prompt, n = body.get("prompt"), len(options.params)
                count = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) else 1
                if count * n > MAX_CHOICES:  # before any is tokenized
                    raise InvalidRequestError(f"{count} prompts x n={n} are {count * n} choices, over the limit of "
                                              f"{MAX_CHOICES} a request; send them in several requests")
                prompts, texts = parse_prompts(prompt, state)
            plans = plan_choices(state.engine, prompts, options)  # checks every prompt before any is decoded
            starts = None  # where each prompt token's text begins, for echo's log-probabilities' text_offset
            if options.echo and options.logprobs is not None:
                starts = []
                for ids in prompts:
                    text = IncrementalText(state.decode)
                    text.extend(ids)
                    starts.append(text.starts)
            return options, prompts, texts, plans, starts

        try:
            options, prompts, texts, plans, prompt_starts = await asyncio.to_thread(prepare)
            del body  # the request's parsed body is not kept while it is answered
            run = Generation(state, prompts, texts, options, chat, plans, prompt_starts)
        except (InvalidRequestError, TypeError, ValueError) as e:
            return error(400, str(e))
        except RendererBusyError as e:
            return error(503, str(e), "unavailable")
        except PreloadError as e:  # the checkpoint's chat template failed: not the request's fault
            return error(500, str(e), "server_error")
        if options.stream:  # a choice that fails ends with finish_reason "error: ..."
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        watcher = asyncio.create_task(cancel_when_gone(request, run))
        try:
            response = await run.collect()
        finally:
            watcher.cancel()
        failed = [c.reason for c in run.choices if (c.reason or "").startswith("error")]
        if failed:  # a 503 when the engine paused for a snapshot: the request may simply be sent again
            return error(503 if run.interrupted else 500, failed[0].removeprefix("error: "),
                         "unavailable" if run.interrupted else "server_error")
        return JSONResponse(response)

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    routes = [Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
              Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]

    return Starlette(exception_handlers={HTTPException: json_errors(routes, "engine")}, routes=routes)


async def cancel_when_gone(request: Request, run: "Generation") -> None:
    """Stops generating for a client that disconnects before its (non-streamed) answer is complete:
    Starlette cancels a streaming response's generator then, but not a plain handler, which went on
    generating every token it had asked for (8 choices of 600 tokens, a client gone after 1 s)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.cancel()


def parse_prompts(prompt, state: WorkerState) -> tuple[list[list[int]], list[str | None]]:
    """OpenAI accepts a string, a list of strings, a list of token ids or a list of such lists.
    Returns the token ids of each prompt and its text where it came as text (for echo)."""
    if isinstance(prompt, list) and sum(len(p) for p in prompt if isinstance(p, str)) > MAX_PROMPT_CHARS \
            or isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequestError(f"the prompt text is over {MAX_PROMPT_CHARS} characters in all, more than any "
                                  "context this engine serves holds; send a shorter prompt")
    if isinstance(prompt, str):
        return [state.encode(prompt)], [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt], [None]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [state.encode(p) for p in prompt], list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt) \
            and all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p):
        return prompt, [None] * len(prompt)
    raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                              "of token ids")


def stop_prefix(text: str, stop: str) -> int:
    """Length of the longest end of `text` that `stop` begins with (shorter than `stop`): what a
    stream holds back until the next token says whether the stop string follows."""
    at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while at >= 0:
        if stop.startswith(text[at:]):
            return len(text) - at
        at = text.find(stop[0], at + 1)
    return 0


def plan_choices(engine, prompts: list[list[int]], options: Options) -> list[list[SamplingParams]]:
    """Each prompt's choices' parameters (a chat without max_tokens gets what its context leaves),
    every prompt checked (Engine.check) before the first one runs."""
    plans = []
    for prompt in prompts:
        params = options.params
        if options.until_full:
            params = [dataclasses.replace(q, max_tokens=max(engine.max_len - len(prompt), 1)) for q in params]
        for q in params:
            engine.check(prompt, q)
        plans.append(params)
    return plans


class Choice:
    """One choice of one prompt: its engine request, the tokens and text it has produced so far."""

    def __init__(self, index: int, prompt: list[int], prefix: str, decode):
        self.index, self.prompt, self.prefix = index, prompt, prefix
        self.request = None
        self.tokens: list[int] = []
        self.text = IncrementalText(decode)
        """The text of the tokens, decoded as they come (up to a stop string's: tokens after it are dropped)."""
        self.sent = ""
        self.logged = 0
        """Tokens whose log-probabilities went out already (streaming)."""
        self.ids_sent = 0
        """Tokens whose ids went out already (streaming with return_token_ids)."""
        self.reason = None
        self.stopped = False
        """A stop string matched: later tokens are not part of the answer."""


class Generation:
    """One /v1/completions or /v1/chat/completions call: every prompt's n choices run as engine
    requests (the choices of a prompt share its prefill), and their tokens come back to the event
    loop through a queue."""

    def __init__(self, state: WorkerState, prompts: list[list[int]], texts: list[str | None], options: Options,
                 chat: bool, plans: list[list[SamplingParams]], prompt_starts: list[list[int]] | None = None):
        """`plans`: each prompt's choices' parameters, checked (plan_choices)."""
        self.state, self.prompts, self.options, self.chat = state, prompts, options, chat
        self.prompt_starts = prompt_starts
        """Where each prompt token's text begins in its prompt's (echo with log-probabilities)."""
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.interrupted = False
        n = len(options.params)
        self.choices: list[Choice] = []
        engine = state.engine
        for p, (prompt, text, params) in enumerate(zip(prompts, texts, plans)):
            prefix = (text if text is not None else state.decode(prompt)) if options.echo else ""
            group = [Choice(p * n + j, prompt, prefix, state.decode) for j in range(n)]
            requests = engine.submit_choices(
                prompt, params, [lambda t, c=c: self._put(c, "token", t) for c in group],
                [lambda r, c=c: self._put(c, "done", r) for c in group])
            for choice, request in zip(group, requests):
                choice.request = request
            self.choices += group
        state.track(self, True)

    def _put(self, choice: Choice, kind: str, value) -> None:
        """Called on the engine's thread. Once the event loop is gone (the server shut down) nobody
        reads the tokens: the choice stops."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (choice, kind, value))
        except RuntimeError:
            choice.request.cancelled = True

    def cancel(self) -> None:
        """Stops generating every choice (the client went away, or the answer is complete)."""
        self.state.track(self, False)
        for choice in self.choices:
            choice.request.cancelled = True

    def interrupt(self, reason: str) -> None:
        """From any thread: every choice not done yet ends now with `reason` (the engine pausing for a
        snapshot, its drain time up), where the server's cancelled task answered a bare 500 or cut
        a stream mid-chunk."""
        self.interrupted = True
        for choice in self.choices:
            self._put(choice, "interrupted", reason)

    def _delta(self, choice: Choice, final: bool) -> str:
        """New text of one choice since the last call. A trailing partial UTF-8 character waits for
        its next token, and so does text that may be the start of a stop string; a stop string ends
        the choice there."""
        if choice.stopped:
            return ""  # the text up to the stop string went out when it matched: nothing after it does
        settled = len(choice.text.settled)
        text = choice.text.extend(choice.tokens)
        searched = text if final else text[:choice.text.whole]  # not a partial character's stand-in
        for stop in self.options.stops:
            # A stop string in the settled text would have been found before: only the end is new.
            cut = searched.find(stop, max(0, settled - len(stop) + 1) if choice.text.incremental else 0)
            if cut >= 0:
                text = searched = text[:cut]
                choice.request.cancelled = choice.stopped = True
        if not (final or choice.stopped):
            if text.endswith("\ufffd"):
                return ""
            text = text[:len(text) - max((stop_prefix(text, stop) for stop in self.options.stops), default=0)]
        delta = text[len(choice.sent):]  # sent only grows: what was streamed is the answer, whatever a decoder redoes
        choice.sent += delta
        return delta

    async def _events(self):
        remaining = len(self.choices)
        while remaining:
            choice, kind, value = await self.events.get()
            if kind == "token":
                if choice.stopped:  # generated before the engine saw the stop: not part of the answer
                    continue
                choice.tokens.append(value)
                if not choice.request.cancelled:
                    yield choice, self._delta(choice, False), None
            elif choice.reason is None:  # not ended already (interrupted, then by the engine)
                remaining -= 1
                choice.reason = value if kind == "interrupted" or not choice.request.cancelled else "stop"
                delta = self._delta(choice, True)
                if kind == "interrupted":
                    choice.request.cancelled = choice.stopped = True
                yield choice, delta, choice.reason

    def _logprobs(self, choice: Choice, upto: int, first: bool) -> dict | None:
        """The log-probabilities of choice's tokens from the last ones sent up to `upto` (with the
        prompt's first, when echoing), in the endpoint's format; None when not asked for."""
        if self.options.logprobs is None:
            return None
        picks: list[tuple[int, Pick | None]] = []
        if first and self.options.echo:
            picks += [(t, p) for t, p in zip(choice.prompt, choice.request.prompt_picks or [None] * len(choice.prompt))]
        start = choice.logged
        picks += [(p.token, p) for p in choice.request.picks[start:upto]]
        choice.logged = max(choice.logged, upto)
        name, raw = self.state.token_name, self.state.token_bytes
        if self.chat:
            return {"content": [{
                "token": name(t), "logprob": p.raw, "bytes": list(raw(t)), "sampling_logprob": p.sampled,
                "top_logprobs": [{"token": name(i), "logprob": lp, "bytes": list(raw(i))} for i, lp in p.top]}
                for t, p in picks]}
        offsets = []  # where each token's text begins in the choice's text (the prompt's, then the answer's)
        if first and self.options.echo:
            offsets += self.prompt_starts[choice.index // len(self.options.params)]
        choice.text.extend(choice.tokens, upto)
        offsets += [len(choice.prefix) + at for at in choice.text.starts[start:upto]]
        return {"tokens": [name(t) for t, _ in picks],
                "token_logprobs": [p.raw if p else None for _, p in picks],
                "top_logprobs": [{name(i): lp for i, lp in p.top} if p else None for _, p in picks],
                "text_offset": offsets,
                "sampling_logprobs": [p.sampled if p else None for _, p in picks]}

    def _choice(self, choice: Choice, text: str, reason, logprobs, token_ids: list[int], first: bool,
                streaming: bool = False) -> dict:
        """One choice of a response, or of a stream chunk (a chat chunk carries a delta)."""
        if not self.chat:
            out = {"index": choice.index, "text": text}
        elif streaming:
            delta = {"role": "assistant", "content": text} if first else {"content": text} if text or not reason else {}
            out = {"index": choice.index, "delta": delta}
        else:
            out = {"index": choice.index, "message": {"role": "assistant", "content": text}}
        out.update(logprobs=logprobs, finish_reason=reason)
        if self.options.return_token_ids:
            out["token_ids"] = token_ids
            if first:
                out["prompt_token_ids"] = choice.prompt
        return out

    async def collect(self) -> dict:
        try:
            async for _ in self._events():
                pass
        finally:  # the client went away (the task is cancelled): stop generating for it
            self.cancel()
        choices = []
        for c in self.choices:
            logprobs = self._logprobs(c, len(c.tokens), True)
            choices.append(self._choice(c, c.prefix + c.sent, c.reason, logprobs, c.tokens, True))
        return {**self._envelope(), "choices": choices, "usage": self._usage()}

    async def stream(self):
        started: set[int] = set()
        try:
            async for choice, delta, reason in self._events():
                first = choice.index not in started
                if not (delta or reason or first):
                    continue
                started.add(choice.index)
                logprobs = self._logprobs(choice, len(choice.tokens), first)
                ids, choice.ids_sent = choice.tokens[choice.ids_sent:], len(choice.tokens)
                text = (choice.prefix if first else "") + delta
                part = self._choice(choice, text, reason, logprobs, ids, first, streaming=True)
                yield f"data: {json.dumps({**self._envelope(), 'choices': [part]})}\n\n"
            if self.options.include_usage:
                yield f"data: {json.dumps({**self._envelope(), 'choices': [], 'usage': self._usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away: stop generating for it
            self.cancel()

    def _envelope(self) -> dict:
        """What every response and stream chunk carries: the model and the weights that answer."""
        kind = ("chat.completion.chunk" if self.options.stream else "chat.completion") if self.chat else \
            "text_completion"
        weights = self.state.weights
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.name,
                "weights_version": weights.version if weights else None,
                "content_digest": weights.content_digest if weights else None}

    def _usage(self) -> dict:
        prompt = sum(map(len, self.prompts))
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
