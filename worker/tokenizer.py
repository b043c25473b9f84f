"""Text <-> token ids with the checkpoint's tokenizer.json (the `tokenizers` library, not the much
slower-to-import transformers), plus its chat template (rendered in a sandbox: chat_template.py)."""

import logging
import os
import pathlib
import re
import threading
from typing import Callable

import tokenizers

from preload_daemon.errors import CheckpointError, InvalidRequestError, PreloadError
from preload_daemon.hfconfig import eos_field, load_json
from preload_daemon.safepath import inside, read_regular
from worker.chat_template import read_template
from worker.template_process import RENDERER

TOKENIZER_MAX_BYTES = 256 << 20
"""Largest tokenizer.json read (real ones are up to a few tens of MiB)."""
TOKENIZER_CONFIG_MAX_BYTES = 16 << 20
"""Largest tokenizer_config.json read (real ones are KiB to a few MiB)."""
MAX_SPECIAL_TOKEN_CHARS = 1024
"""Longest bos_token or eos_token handed to the chat template (real ones are a few characters)."""
MAX_REPLACEMENT_CHARS = 64
"""Longest text a normalizer, pre-tokenizer or decoder step of tokenizer.json puts in place of what
it matches (a Replace's content, a Prepend's or Metaspace's text; real ones are a character or
two): one of 100,000 characters for 'æ' took an engine 9 MB of memory a character of prompt."""
MAX_TOKEN_CHARS = 4096
"""Longest text one token of the vocabulary may stand for (real ones: under a hundred-odd characters).
Checked as tokens are first decoded, not at load (a scan of the vocabulary costs 25-45 ms of every
start): a token of 32 MiB made an echo of 24 of them 805 MB and 4 GB of an engine's memory."""
MAX_CHARS_PER_TOKEN = 256
"""Most characters of text one token stands for, as far as the bound on a prompt's text before it is
tokenized goes (WorkerState.encode: more than the context times this cannot fit); real tokenizers'
longest tokens are under a hundred-odd characters (the default model's: 81)."""
FIX = "fix or re-export tokenizer.json and tokenizer_config.json"
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
log = logging.getLogger(__name__)


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet, a character per byte: printable ones as themselves, the others
    from U+0100 on, in order (so a space is "Ġ")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_LEVEL = _byte_level()


class Tokenizer:
    def __init__(self, path: pathlib.Path, allow_external: bool = False):
        """Reads the tokenizer's files with read_file (a link out of the directory would hand its
        target to every client: a chat template's text comes back in prompt_token_ids)."""
        def read(name: str, limit: int) -> bytes:
            return read_file(path, name, limit, allow_external)

        config_path = path / "tokenizer_config.json"
        config = load_json(read(config_path.name, TOKENIZER_CONFIG_MAX_BYTES), str(config_path), FIX) \
            if os.path.lexists(config_path) else {}
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path} is not a JSON object; {FIX}")
        self._special = {k: _special_token(config, k, config_path) for k in ("bos_token", "eos_token")}
        self._template, self._template_origin = read_template(path, config, read)
        # A syntax error fails the load, not a request: the template compiles in a renderer child
        # (bounded in memory and time, as its renders are), beside the vocabulary's parse here.
        checked = _in_background(RENDERER.check, self._template, self._template_origin) \
            if self._template is not None else None
        self._tok = tokenizers.Tokenizer.from_str(read("tokenizer.json", TOKENIZER_MAX_BYTES).decode("utf-8"))
        self._encode_many = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        self._bytes: dict[int, bytes] = {}
        self._lengths: dict[int, int] = {}  # each token's text's length, as decode() first meets it
        self._added = self._tok.get_added_tokens_decoder()
        self.expansion = _expansion(self._tok)
        """The most characters a step of the tokenizer makes of one (1, or what MAX_REPLACEMENT_CHARS bounds)."""
        if checked is not None:
            checked()

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

    def max_text_chars(self, max_tokens: int) -> int:
        """The longest text worth tokenizing for a context of `max_tokens`: one longer cannot fit
        (MAX_CHARS_PER_TOKEN), or would cost more than a context's worth of characters, expanded."""
        return max_tokens * MAX_CHARS_PER_TOKEN // self.expansion

    def encode(self, text: str) -> list[int]:
        """The text's ids. The library's batch call lets the GIL go while it works, where its encode
        holds it: an 8 Mi-character prompt stopped the engine's every other thread for 7 s, /health's
        and the scheduler's too."""
        try:
            return _library_call(self._encode_many, [text])[0].ids
        except TypeError:  # the library's own words: "TextEncodeInput must be Union[TextInputSequence, ...]"
            raise InvalidRequestError("the text cannot be tokenized: it is not valid Unicode (a lone surrogate "
                                      "such as \\ud800 is not); send valid text") from None

    def decode(self, ids: list[int]) -> str:
        self._check_lengths(ids)
        return _library_call(self._tok.decode, ids, skip_special_tokens=True)

    def _check_lengths(self, ids: list[int]) -> None:
        """CheckpointError if a token's text is over MAX_TOKEN_CHARS (each token looked up once)."""
        lengths = self._lengths
        for token in ids:
            n = lengths.get(token)
            if n is None:
                added = self._added.get(token)
                n = lengths[token] = len(added.content if added is not None else self._tok.id_to_token(token) or "")
            if n > MAX_TOKEN_CHARS:
                raise CheckpointError(f"token {token} of the checkpoint's tokenizer stands for {n} characters, over "
                                      f"the {MAX_TOKEN_CHARS} one token may (real ones: a hundred-odd); {FIX}")

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token adds to a text: a character may span tokens (an emoji is often
        three), and each token has only its share of its bytes, where its text alone is a
        replacement character. Byte-level tokenizers (GPT-2's table of a printable character per
        byte) and SentencePiece's byte fallback (<0xE2>) are read back to their bytes, its ▁ to a
        space; an added token is its own text (a special one, which decoding skips, too)."""
        known = self._bytes.get(token)
        if known is None:
            known = self._bytes[token] = self._read_bytes(token)
        return known

    def _read_bytes(self, token: int) -> bytes:
        self._check_lengths([token])
        added = self._added.get(token)
        if added is not None:
            return added.content.encode()
        piece = self._tok.id_to_token(token) or ""
        if isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel) and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if (fallback := BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(fallback[1], 16)])
        if "▁" in piece:  # SentencePiece's space, which decoding a token alone drops at its start
            return piece.replace("▁", " ").encode()
        return self._tok.decode([token], skip_special_tokens=False).encode()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def chat_prompt(self, messages: list[dict]) -> str:
        """The chat template rendered on `messages`, in a child process (worker/template_process.py)."""
        if self._template is None:
            raise InvalidRequestError("this checkpoint has no chat template; send a plain prompt")
        return RENDERER.render(self._template, self._template_origin,
                               dict(messages=messages, add_generation_prompt=True, **self._special))


def read_file(path: pathlib.Path, name: str, limit: int, allow_external: bool, fix: str = FIX) -> bytes:
    """A file of the checkpoint beside the tokenizer, read as the checkpoint's are: a regular file
    only (a FIFO would block the engine for good), bounded in size, and inside the directory unless
    `allow_external` (a link out of it would hand its target to every client)."""
    root = pathlib.Path(os.path.realpath(path))
    return read_regular(inside(root, path / name, allow_external), limit, fix, None if allow_external else root)


GENERATION_CONFIG_MAX_BYTES = 1 << 20
"""Largest generation_config.json read (real ones are under a KiB)."""


def generation_eos(path: pathlib.Path, allow_external: bool = False) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an integer or a list of them), or () without one.
    transformers' generate and vLLM stop on these too: some checkpoints list an end-of-turn token
    only here (config.json's eos was all the engine stopped on, and a chat ran past its turn)."""
    file = path / "generation_config.json"
    if not os.path.lexists(file):
        return ()
    fix = "fix generation_config.json or remove it"
    config = load_json(read_file(path, file.name, GENERATION_CONFIG_MAX_BYTES, allow_external, fix), str(file), fix)
    return eos_field(config, str(file), fix) if isinstance(config, dict) else ()


def _expansion(tok: tokenizers.Tokenizer) -> int:
    """The longest replacement text in the tokenizer's normalizer, pre-tokenizer and decoder (at
    least 1); CheckpointError past MAX_REPLACEMENT_CHARS. Read from each step's own JSON."""
    longest, where = 1, ""
    for part, name in ((tok.normalizer, "normalizer"), (tok.pre_tokenizer, "pre_tokenizer"), (tok.decoder, "decoder")):
        stack = [load_json(part.__getstate__(), f"tokenizer.json's {name}", FIX)] if part is not None else []
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                for key in ("content", "prepend", "replacement"):
                    if isinstance(text := node.get(key), str) and len(text) > longest:
                        longest, where = len(text), f"{name}'s {node.get('type')} {key}"
                stack += node.values()
            elif isinstance(node, list):
                stack += node
    if longest > MAX_REPLACEMENT_CHARS:
        raise CheckpointError(f"tokenizer.json's {where} is {longest} characters, over the {MAX_REPLACEMENT_CHARS} "
                              f"a step may put in place of what it matches (real ones: one or two); {FIX}")
    return longest


def _in_background(call, *args) -> Callable[[], None]:
    """Starts call(*args) on a thread; the function returned waits for it and raises what it raised.
    A renderer that cannot start (no processes left to this user) is the host's, not the template's:
    logged, and chat requests say why."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call(*args)
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="template-check", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failed and isinstance(failed[0], CheckpointError):
            raise failed[0]
        if failed:
            log.warning("the chat template could not be checked as the tokenizer loaded (%s: %s); chat requests "
                        "will say why", type(failed[0]).__name__, failed[0])

    return wait


def _library_call(call, *args, **kwargs):
    """call(*args, **kwargs) into the tokenizers library, whose panics (a regex past its limit of
    retries, in a checkpoint's pre-tokenizer) come up as pyo3's PanicException, a BaseException that
    no handler for Exception catches: a plain-text 500 and a traceback, or a `preload generate`
    traceback. Its errors other than TypeError are the tokenizer's doing: a CheckpointError."""
    try:
        return call(*args, **kwargs)
    except (TypeError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise CheckpointError(f"the checkpoint's tokenizer failed on this text ({type(e).__name__}: "
                              f"{str(e)[:200]}); {FIX}") from None


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


MAX_CONTEXT_TOKENS = 64
"""Tokens without text (skipped special tokens) IncrementalText keeps in its context."""
MAX_PENDING_TOKENS = 16
"""Tokens a partial character may span (UTF-8's are at most 4 bytes) before what they make settles as it is."""


class IncrementalText:
    """The text of a growing list of tokens, decoded as they come: the new tokens after a context,
    the tokens that made the text before them and those without text since (a decoder may treat a
    text's first token apart: SentencePiece's drops its space). Decoding every token on every token
    was quadratic (the default model's tokenizer: 0.23 s of CPU for 2,048 tokens, 4.5 s for 8,192).
    A partial UTF-8 character at the end settles with the token that completes it, and stands as
    one replacement character until then, the final text included (byte fallback decodes a run of
    byte tokens as one: an incomplete run would turn the characters before it in the run into
    replacement characters too, which went out already). A decoder whose text is not a running
    concatenation gets the tokens decoded whole from then on."""

    def __init__(self, decode):
        self.decode = decode
        self.tokens: list[int] = []
        self.settled = ""
        """The text of tokens[:read]: decoding more tokens does not change it."""
        self.read = 0
        self.anchor: list[int] = []
        """The tokens that made the last text settled, decoded again before the new ones ..."""
        self.quiet: list[int] = []
        """... with those since that made no text (skipped special tokens; at most MAX_CONTEXT_TOKENS)."""
        self.pending = ""
        """The text of tokens[read:], which ends in a partial character."""
        self.incremental = True
        self.text = ""
        """The text of all the tokens (a partial character at its end stands as a replacement)."""
        self.starts: list[int] = []
        """Where each token's text begins: the whole characters before it (a token that ends a
        character begins where that character does)."""

    @property
    def whole(self) -> int:
        """Characters of the text that no later token changes (a partial character's are not)."""
        return len(self.settled) + len(self.pending.rstrip("\ufffd")) if self.incremental else \
            len(self.text.rstrip("\ufffd"))

    def extend(self, tokens: list[int], end: int | None = None) -> str:
        """The text of `tokens[:end]`, which begin with those already added (no copy of them: a
        streamed choice extends on every token)."""
        for i in range(len(self.tokens), len(tokens) if end is None else end):
            self.add(tokens[i])
        return self.text

    def add(self, token: int) -> None:
        tokens = self.tokens
        self.starts.append(self.whole)
        tokens.append(token)
        if self.incremental:
            context = self.anchor + self.quiet
            before = self.decode(context)
            now = self.decode(context + tokens[self.read:])
            follows = now.startswith(before)
            if now.endswith("\ufffd") and len(tokens) - self.read <= MAX_PENDING_TOKENS:
                self.pending = now[len(before):] if follows else "\ufffd"  # nothing settles until it completes
                self.text = self.settled + self.pending
                return
            self.incremental = follows
        if not self.incremental:
            self.text = self.decode(tokens)
            return
        new = now[len(before):]
        self.settled += new
        if new:
            self.anchor, self.quiet = tokens[self.read:], []
        else:
            self.quiet = (self.quiet + tokens[self.read:])[-MAX_CONTEXT_TOKENS:]
        self.read, self.pending, self.text = len(tokens), "", self.settled
