"""A checkpoint's chat template is code that comes with the checkpoint, i.e. untrusted input: it is
rendered in Jinja's immutable sandbox, as transformers does, with the helpers real templates call
(`raise_exception`, `strftime_now`, transformers' `tojson`), and with bounds on its size, on the
size of what it renders and on the values it may build on the way. The engine renders in a child
process that runs this module (template_process.py), so that what these bounds cannot stop costs
that child."""

import contextlib
import datetime
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.sandbox

from preload_daemon.errors import CheckpointError, InvalidRequestError, PreloadError
from worker import template_bounds as bounds
from worker.template_bounds import MAX_PROMPT_CHARS

MAX_TEMPLATE_BYTES = 1 << 20
"""Real chat templates are a few KiB; a bigger one is refused when the tokenizer loads."""
MAX_RENDER_SECONDS = 5.0
"""Longest a template may run on one request's messages (real ones take milliseconds)."""


def read_template(path: pathlib.Path, config: dict, read: Callable[[str, int], bytes]) -> tuple[str | None, str]:
    """The chat template's source (chat_template.jinja, else tokenizer_config.json's chat_template,
    or the one named "default" where that is a list) and where it came from, for error messages;
    refuses one over MAX_TEMPLATE_BYTES. `read(name, limit)` reads a file of the checkpoint as the
    tokenizer's other files are (worker/tokenizer.py)."""
    file = path / "chat_template.jinja"
    if os.path.lexists(file):  # a FIFO, a device or a link out of the directory: `read` refuses it
        origin = str(file)
        try:
            source = read(file.name, MAX_TEMPLATE_BYTES).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{origin}: the chat template is not UTF-8 ({e}); re-save it as UTF-8") from None
        return source, origin
    origin, source = f"{path / 'tokenizer_config.json'} (chat_template)", config.get("chat_template")
    if isinstance(source, list):  # named templates, as transformers saves them: chats use "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            names = ", ".join(sorted(repr(n)[:40] for n in named)[:8]) or "none"
            raise CheckpointError(f"{origin}: a list of templates (names: {names}) with no 'default' one, which chats "
                                  "use; name one 'default', or put the model's published template in its place")
        origin, source = f"{path / 'tokenizer_config.json'} (chat_template 'default')", named["default"]
    if not isinstance(source, str):
        return None, origin
    if len(source.encode()) > MAX_TEMPLATE_BYTES:
        raise CheckpointError(f"{origin}: the chat template is {len(source.encode())} bytes, over the "
                              f"{MAX_TEMPLATE_BYTES}-byte limit (real ones are a few KiB); replace it with the model's "
                              "published template")
    return source, origin


def compile_template(source: str, origin: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{origin}: the chat template does not parse (line {e.lineno}: {e.message}); "
                              "fix it or replace it with the model's published template") from None


def render_template(template: jinja2.Template, origin: str, context: dict,
                    seconds: float = MAX_RENDER_SECONDS) -> str:
    """The rendered prompt, stopped once over MAX_PROMPT_CHARS or `seconds`. Whatever goes wrong
    inside the template becomes a PreloadError whose message says whose fault it is."""
    pieces, size = [], 0
    try:
        with _deadline(seconds):
            for piece in template.generate(**context):
                size += len(piece)
                if size > MAX_PROMPT_CHARS:
                    raise InvalidRequestError(f"the chat prompt rendered from these messages exceeds "
                                              f"{MAX_PROMPT_CHARS} characters; send shorter messages (if they are "
                                              f"short, {origin} is at fault: replace its chat template)")
                pieces.append(piece)
    except PreloadError:
        raise
    except RenderTimeout:
        raise CheckpointError(f"{origin}: the chat template ran for more than {seconds:g} s on these "
                              "messages and was stopped (real ones take milliseconds); the template is broken or "
                              "malicious: replace it with the model's published template") from None
    except TemplateRaised as e:
        raise InvalidRequestError(f"the chat template refuses these messages: {e.message}; change them as "
                                  "it asks, or send a plain prompt") from None
    except jinja2.sandbox.SecurityError as e:
        raise CheckpointError(f"{origin}: the chat template tried something its sandbox forbids ({_short(e)}), "
                              "so it was not rendered; the template is broken or malicious: replace it with "
                              "the model's published template") from None
    except Exception as e:  # untrusted code may fail in any way (TypeError, RecursionError, MemoryError...)
        raise CheckpointError(f"{origin}: the chat template failed on these messages ({type(e).__name__}: "
                              f"{_short(e)}); fix the template, or send a plain prompt") from None
    return "".join(pieces)


class RenderTimeout(Exception):
    """A template that ran past its time: raised into its own code by _deadline's tracer."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Stops the template run inside (in this thread) once `seconds` have passed: a trace function
    sees every line the template's compiled code runs and raises RenderTimeout into it. Loops are what a
    template can run forever (three nested range(100000) loops with an empty body build nothing the
    size bounds could catch); the lines in between cost a few microseconds of tracing."""
    deadline, lines = time.monotonic() + seconds, 0

    def in_template(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % 256 == 0 and time.monotonic() > deadline:
            raise RenderTimeout()
        return in_template

    def tracer(frame, event, arg):
        # Only the template's own code: raised in a library's frame, inside a `try: ... except
        # Exception` (Jinja's `is sequence` test has one), the timeout would be swallowed, and a
        # trace function that raises is switched off for good.
        return in_template if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def _short(error: Exception) -> str:
    return " ".join(str(error).split())[:200]


class TemplateRaised(jinja2.TemplateError):
    """What a template's raise_exception(message) raises: it refuses the messages it was given."""


def raise_exception(message) -> None:
    raise TemplateRaised(str(message)[:500])


def strftime_now(format: str) -> str:
    """Today's date for templates that state it (Llama 3's "Today Date: 26 Jul 2024")."""
    return datetime.datetime.now().strftime(format)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: plain json.dumps, without Jinja's HTML escaping of <, >, & and '."""
    bounds.check_tojson(value, indent)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class TemplateNamespace(jinja2.utils.Namespace):
    """transformers' namespace(): no underscore-prefixed attributes, the way into CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]  # Jinja's signature trick, so that namespace(self=...) still works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"a namespace attribute may not start with '_' (got {name!r})")


class GenerationTag(jinja2.ext.Extension):
    """Parses transformers' {% generation %}...{% endgeneration %} (it marks the assistant's tokens for
    training masks) and renders its body unchanged, so templates that use it still work here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _BoundedConcat(jinja2.compiler.CodeGenerator):
    """Compiles `~` into ChatSandbox.checked_join (the sandbox intercepts operators like + and *, but
    Jinja compiles ~ into a plain join). Autoescaping is off for chat templates, so the join is
    always str_join's."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox (no attribute that reaches Python internals, no mutating methods) that
    also refuses to build a huge value in one step ('x' * 10**10, 2 ** 10**10, '%9999999999d' % 1,
    'x'.ljust(10**10), '{:>9999999999}'.format(1), ...), which would exhaust memory or CPU before
    the output bound could act."""

    intercepted_binops = frozenset(("*", "**", "%", "+"))
    code_generator_class = _BoundedConcat

    def unsafe_undefined(self, obj, attribute):
        """Jinja returns an undefined that fails only if used further, so `''.__class__` alone prints
        nothing; no real template touches such attributes, so refuse at once, with a clear error."""
        raise jinja2.sandbox.SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                                           "object is unsafe")

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            bounds.check_repeat(left, right)
            bounds.check_repeat(right, left)
        elif operator == "**":
            bounds.check_power(left, right)
        elif operator == "%" and isinstance(left, str):
            bounds.check_percent(left, right)
        elif operator == "+":
            bounds.check_add(left, right)
        return super().call_binop(context, operator, left, right)

    concat = staticmethod(bounds.check_concat)  # what Jinja joins a block's text with

    @staticmethod
    def checked_join(values) -> str:
        """`a ~ b ~ ...`: Jinja's str_join, measured first (40 doublings of a string by ~ would
        exhaust memory before the output bound could act)."""
        bounds.check_weight(values, what="joining with ~")
        return "".join(map(str, values))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)):
            args = bounds.check_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        bounds.check_result(result)
        return result

    def wrap_str_format(self, value):
        """Jinja's sandboxed str.format and format_map (it wraps them when they are looked up), bounded."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        @functools.wraps(wrapped)
        def bounded(*args, **kwargs):
            bounds.check_format(value.__self__, args, kwargs)
            return wrapped(*args, **kwargs)
        return bounded


def _bounded_filter(name: str, function):
    """A filter that refuses huge integer arguments after its value (center(10**10), indent(10**10),
    slice(10**10), ...: widths and counts), measures the value of a filter that turns it into text,
    and refuses a result over the limit."""
    first_option = 2 if getattr(function, "jinja_pass_arg", None) else 1  # after the context, if passed

    @functools.wraps(function)  # keeps Jinja's pass_context/pass_environment marker
    def bounded(*args, **kwargs):
        bounds.check_sizes(args[first_option:], kwargs)
        if name in bounds.TEXT_FILTERS and len(args) >= first_option:
            bounds.check_weight(args[first_option - 1], what=f"the value of the {name} filter")
        if name in bounds.ITEM_FILTERS and len(args) >= first_option:
            bounds.check_items(args[first_option - 1], name)
        result = function(*args, **kwargs)
        bounds.check_result(result)
        return result
    return bounded


@jinja2.pass_eval_context
def _join_filter(eval_ctx, value, d="", attribute=None):
    if attribute is not None:
        value = map(jinja2.filters.make_attrgetter(eval_ctx.environment, attribute), value)
    return jinja2.filters.do_join(eval_ctx, bounds.check_join(value, d), d)


@jinja2.pass_environment
def _sum_filter(environment, iterable, attribute=None, start=0):
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    return jinja2.filters.do_sum(environment, bounds.check_sum(iterable, start), start=start)


@jinja2.pass_eval_context
def _replace_filter(eval_ctx, value, old, new, count=None):
    bounds.check_replace(value, old, new, count)
    return jinja2.filters.do_replace(eval_ctx, value, old, new, count)


@jinja2.pass_environment
def _wordwrap_filter(environment, value, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    bounds.check_wordwrap(value, width, wrapstring or environment.newline_sequence)
    return jinja2.filters.do_wordwrap(environment, value, width, break_long_words, wrapstring, break_on_hyphens)


def _indent_filter(value, width=4, first=False, blank=False):
    bounds.check_indent(value, width)
    return jinja2.filters.do_indent(value, width, first, blank)


def _format_filter(value, *args, **kwargs):
    """Jinja's format filter ('%5d'|format(n)) with the same bounds as the % operator."""
    if isinstance(value, str):
        bounds.check_percent(value, args if args else kwargs)
    return jinja2.filters.do_format(value, *args, **kwargs)


def _finalize(value):
    """Every {{ value }} printed: a list of references to one long string is light to hold but
    huge as text, so it is measured before it is turned into text."""
    if not isinstance(value, str):
        bounds.check_weight(value, what="a value printed")
    return value


@functools.cache
def _environment() -> ChatSandbox:
    """One shared environment: sandboxed and immutable, so templates of different checkpoints
    compiled in it cannot affect one another."""
    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationTag],
                      finalize=_finalize, optimized=False)  # no folding of constants at load time, out of the deadline
    env.filters.update(tojson=tojson, format=_format_filter, replace=_replace_filter, join=_join_filter,
                       sum=_sum_filter, indent=_indent_filter, wordwrap=_wordwrap_filter)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=TemplateNamespace)
    del env.globals["lipsum"]  # lorem ipsum of any length: no chat template needs it
    return env
