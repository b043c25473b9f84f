"""The OpenAI-compatible request fields the engine takes, field by field, and how they become
SamplingParams. A field that is unknown, or known but not supported, is refused with a 400 that
names it: nothing is silently ignored (docs/api.md lists the surface against vLLM's).
"""

import dataclasses

from preload_daemon.errors import InvalidRequestError
from worker.requests import SamplingParams
from worker.sampling import MAX_TOP_LOGPROBS
from worker.template_bounds import MAX_PROMPT_CHARS

MAX_N = 16
MAX_MESSAGES = 65_536  # a chat's messages (their text is bounded too: MAX_PROMPT_CHARS in all)
MAX_STOPS = 16
MAX_STOP_CHARS = 1024

# Fields both endpoints take.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "user",
           # extensions (vLLM's names)
           "ignore_eos", "stop_token_ids", "repetition_penalty", "return_token_ids"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Known to OpenAI's API but not supported here: refused with this reason.
REFUSED = {
    "suffix": "insertion (suffix) is not supported",
    "best_of": "best_of is not supported; use n",
    "logit_bias": "logit_bias is not supported",
    "tools": "tool calling is not supported", "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "response_format": "structured output (response_format) is not supported",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "reasoning_effort is not supported",
    "store": "stored completions are not supported", "metadata": "stored completions are not supported",
    "service_tier": "service tiers are not supported", "web_search_options": "web search is not supported",
}


@dataclasses.dataclass(slots=True)
class Options:
    """One request's parsed options (both endpoints)."""
    params: list[SamplingParams]
    """One per choice (n of them), each with its own seed when a seed was given."""
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    """Top alternatives per token (0: the chosen token's only); None: no log-probabilities."""
    echo: bool = False
    return_token_ids: bool = False
    until_full: bool = False
    """No max_tokens given to chat: generate until the end of sequence or of the context."""


def check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    for name in body:
        if name in REFUSED and name not in allowed:
            if name == "response_format" and body[name] in ({"type": "text"}, None):
                continue
            raise InvalidRequestError(f"{name}: {REFUSED[name]} here ({endpoint})")
        if name not in allowed:
            raise InvalidRequestError(f"unknown field {name!r} for {endpoint}; see the engine's API documentation "
                                      "for the fields it takes")


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InvalidRequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    try:
        return kind(value)
    except OverflowError:  # a 400-digit integer as a float
        raise InvalidRequestError(f"{name} is out of range ({str(value)[:20]}...)") from None


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {value!r}")
    return value


def parse_options(body: dict, *, chat: bool) -> Options:
    """SamplingParams and response options for a /v1/completions or /v1/chat/completions body."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "/v1/chat/completions" if chat else
                 "/v1/completions")
    n = _number(body, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {n}")
    max_tokens = _number(body, "max_completion_tokens", None, int) if chat else None
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"max_completion_tokens must be at least 1, got {max_tokens}")
    max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", None, int)
    until_full = max_tokens is None and chat  # chat, as OpenAI's: up to the context's end (completions: 16)
    max_tokens = max_tokens if max_tokens is not None else 16
    if chat:
        logprobs = _number(body, "top_logprobs", 0, int) if _flag(body, "logprobs") else None
        if body.get("top_logprobs") is not None and logprobs is None:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
    else:
        logprobs = _number(body, "logprobs", None, int)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"{'top_logprobs' if chat else 'logprobs'} must be in [0, {MAX_TOP_LOGPROBS}], "
                                  f"got {logprobs}")
    echo = not chat and _flag(body, "echo")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage", "continuous_usage_stats"} \
            or stream_options.get("continuous_usage_stats"):
        raise InvalidRequestError("stream_options takes only include_usage (true or false)")
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise InvalidRequestError(f"stream_options.include_usage must be true or false, got "
                                  f"{stream_options['include_usage']!r}")
    stream = _flag(body, "stream")
    if stream_options and not stream:
        raise InvalidRequestError("stream_options needs stream: true")
    stops = body.get("stop")
    stops = [] if stops is None else [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops) \
            or len(stops) > MAX_STOPS:
        raise InvalidRequestError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at "
                                  f"most {MAX_STOP_CHARS} characters")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise InvalidRequestError("stop_token_ids must be a list of token ids")
    seed = _number(body, "seed", None, int)
    if seed is not None and not -2**63 <= seed <= 2**63 - n:  # choice i draws with seed + i, a 64-bit integer
        raise InvalidRequestError(f"seed must be in [-2**63, 2**63 - n] (n = {n}), got {seed}")
    base = dict(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
                top_p=_number(body, "top_p", 1.0), stop_token_ids=tuple(stop_ids),
                ignore_eos=_flag(body, "ignore_eos"), logprobs=logprobs,
                prompt_logprobs=logprobs if echo and logprobs is not None else None,
                presence_penalty=_number(body, "presence_penalty", 0.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0),
                repetition_penalty=_number(body, "repetition_penalty", 1.0))
    # Choice i of n draws with seed + i: each choice is reproducible from its own seed.
    params = [SamplingParams(**base, seed=None if seed is None else seed + i) for i in range(n)]
    return Options(params, stream, bool(stream_options.get("include_usage")), stops, logprobs, echo,
                   _flag(body, "return_token_ids"), until_full)


def parse_messages(messages) -> list[dict]:
    """Chat messages as the template takes them: role and text content (a string, or a list of
    text parts, joined)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError(f"{len(messages)} messages is over the limit of {MAX_MESSAGES}; send fewer")
    out, chars = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a role")
        if set(message) - {"role", "content", "name"}:
            raise InvalidRequestError(f"messages[{i}]: unsupported field(s) "
                                      f"{', '.join(sorted(set(message) - {'role', 'content', 'name'}))}")
        if message["role"] not in ("system", "developer", "user", "assistant"):
            raise InvalidRequestError(f"messages[{i}].role {message['role']!r}: use system, developer, user or "
                                      "assistant (tool messages are not supported)")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
        chars += len(content)
    if chars > MAX_PROMPT_CHARS:  # their prompt would be: refused before they go to the template
        raise InvalidRequestError(f"the messages hold {chars} characters in all, over the {MAX_PROMPT_CHARS}-character "
                                  "limit of a prompt; send shorter messages")
    return out
