"""Text <-> token ids with the checkpoint's tokenizer.json (the `tokenizers` library, not the much
slower-to-import transformers), plus its chat template (rendered in a sandbox: chat_template.py)."""

import json
import pathlib

import tokenizers

from preload_daemon.errors import CheckpointError, InvalidRequestError, PreloadError
from worker.chat_template import compile_template, read_template, render_template


class Tokenizer:
    def __init__(self, path: pathlib.Path):
        self._tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        self._texts: dict[int, str] = {}
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._special = {k: config.get(k) or "" for k in ("bos_token", "eos_token")}
        source, self._template_origin = read_template(path, config)
        self._template = compile_template(source, self._template_origin) if source is not None else None

    @classmethod
    def load(cls, path: pathlib.Path) -> "Tokenizer | None":
        """The checkpoint's tokenizer, or None if it ships none (then only token-id prompts work)."""
        if not (path / "tokenizer.json").exists():
            return None
        try:
            return cls(path)
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

    def chat_prompt(self, messages: list[dict]) -> str:
        if self._template is None:
            raise InvalidRequestError("this checkpoint has no chat template; send a plain prompt")
        return render_template(self._template, self._template_origin,
                               messages=messages, add_generation_prompt=True, **self._special)
