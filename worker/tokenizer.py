"""Text <-> token ids with the checkpoint's tokenizer.json (the `tokenizers` library, not the much
slower-to-import transformers), plus its chat template (rendered in a sandbox: chat_template.py)."""

import os
import pathlib

import tokenizers

from preload_daemon.errors import CheckpointError, InvalidRequestError, PreloadError
from preload_daemon.hfconfig import load_json
from preload_daemon.safepath import inside, read_regular
from worker.chat_template import compile_template, read_template
from worker.template_process import RENDERER

TOKENIZER_MAX_BYTES = 256 << 20
"""Largest tokenizer.json read (real ones are up to a few tens of MiB)."""
TOKENIZER_CONFIG_MAX_BYTES = 16 << 20
"""Largest tokenizer_config.json read (real ones are KiB to a few MiB)."""
MAX_SPECIAL_TOKEN_CHARS = 1024
"""Longest bos_token or eos_token handed to the chat template (real ones are a few characters)."""
FIX = "fix or re-export tokenizer.json and tokenizer_config.json"


class Tokenizer:
    def __init__(self, path: pathlib.Path, allow_external: bool = False):
        """Reads the tokenizer's files as the checkpoint's are read: regular files only (a FIFO
        would block the engine for good), bounded in size, and inside the directory unless
        `allow_external` (a link out of it would hand its target to every client: a chat template's
        text comes back in prompt_token_ids)."""
        root = pathlib.Path(os.path.realpath(path))

        def read(name: str, limit: int) -> bytes:
            return read_regular(inside(root, path / name, allow_external), limit, FIX)

        self._tok = tokenizers.Tokenizer.from_str(read("tokenizer.json", TOKENIZER_MAX_BYTES).decode("utf-8"))
        self._texts: dict[int, str] = {}
        config_path = path / "tokenizer_config.json"
        config = load_json(read(config_path.name, TOKENIZER_CONFIG_MAX_BYTES), str(config_path), FIX) \
            if os.path.lexists(config_path) else {}
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path} is not a JSON object; {FIX}")
        self._special = {k: _special_token(config, k, config_path) for k in ("bos_token", "eos_token")}
        self._template, self._template_origin = read_template(path, config, read)
        if self._template is not None:
            compile_template(self._template, self._template_origin)  # a syntax error fails the load, not a request

    @classmethod
    def load(cls, path: pathlib.Path, allow_external: bool = False) -> "Tokenizer | None":
        """The checkpoint's tokenizer, or None if it ships none (then only token-id prompts work)."""
        if not os.path.lexists(path / "tokenizer.json"):
            return None
        try:
            return cls(path, allow_external)
        except PreloadError:
            raise
        except Exception as e:  # the tokenizers library raises plain Exception on a malformed file
            raise CheckpointError(f"{path}: cannot read its tokenizer ({type(e).__name__}: {str(e)[:200]}); fix or "
                                  "re-export tokenizer.json and tokenizer_config.json") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (what log-probabilities name)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tok.decode([token], skip_special_tokens=False)
        return text

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def chat_prompt(self, messages: list[dict]) -> str:
        """The chat template rendered on `messages`, in a child process (worker/template_process.py)."""
        if self._template is None:
            raise InvalidRequestError("this checkpoint has no chat template; send a plain prompt")
        return RENDERER.render(self._template, self._template_origin,
                               dict(messages=messages, add_generation_prompt=True, **self._special))


def _special_token(config: dict, key: str, where: pathlib.Path) -> str:
    """A special token's text for the chat template, as transformers gives it: a string, or the
    content of a serialized AddedToken; anything else (a checkpoint's 8M-item list went to every
    chat request) is refused when the tokenizer loads."""
    value = config.get(key) or ""
    if isinstance(value, dict):
        value = value.get("content", "")
    if not isinstance(value, str) or len(value) > MAX_SPECIAL_TOKEN_CHARS:
        raise CheckpointError(f"{where}: {key} must be a string (or an object with a string content) of at most "
                              f"{MAX_SPECIAL_TOKEN_CHARS} characters; {FIX}")
    return value
