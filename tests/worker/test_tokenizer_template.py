"""A checkpoint's chat template is untrusted code: it renders in a sandbox that keeps it away from
Python's internals and bounds what it may build, and each way it can fail is a one-line error that
says whose fault it is. A normal template still renders as transformers would render it."""

import datetime
import json
import os
import pathlib
import shutil
import threading
import time

import pytest
import tokenizers

from preload_daemon.errors import CheckpointError, InvalidRequestError
from worker.chat_template import MAX_PROMPT_CHARS, MAX_TEMPLATE_BYTES
from worker.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER = [{"role": "user", "content": "What is 2+2?"}]


def checkpoint(path: pathlib.Path, template: str | None = None, template_file: str | None = None) -> pathlib.Path:
    """A tokenizer-only checkpoint directory: a word-level tokenizer.json and the given template."""
    path.mkdir(exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", **({"chat_template": template} if template else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    return path


def render(tmp_path, template: str, messages=USER) -> str:
    return Tokenizer.load(checkpoint(tmp_path / "model", template)).chat_prompt(messages)


def assert_one_line(error: pytest.ExceptionInfo) -> None:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message, message


def test_chatml_renders_as_before(tmp_path):
    messages = [{"role": "user", "content": "Hi <b>&</b> Ünïcödé 🚀"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    assert render(tmp_path, CHATML, messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\nHi <b>&</b> Ünïcödé 🚀"
        "<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_template_file_wins_and_trims_blocks(tmp_path):
    """chat_template.jinja overrides tokenizer_config.json; trim_blocks and lstrip_blocks as in transformers."""
    source = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]{{ eos_token }}\n"
              "    {% endif %}\n{% endfor %}")
    tokenizer = Tokenizer(checkpoint(tmp_path / "model", "ignored", template_file=source))
    assert tokenizer.chat_prompt(USER) == "[What is 2+2?]<|im_end|>\n"


def test_no_template_asks_for_a_plain_prompt(tmp_path):
    with pytest.raises(InvalidRequestError, match="no chat template; send a plain prompt"):
        Tokenizer(checkpoint(tmp_path / "model")).chat_prompt(USER)


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ cycler.__init__.__globals__.os.system('touch {canary}') }}",
    "{{ joiner.__init__.__globals__['__builtins__']['open']('{canary}', 'w') }}",
    "{{ namespace.__init__.__globals__.os.system('touch {canary}') }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace(__class__=1) %}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{{ messages[0].update(role='system') }}",
    "{{ ''.format.__self__.__class__ }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ self.__init__ }}",
    "{{ self._TemplateReference__context }}",
])
def test_sandbox_escapes_are_refused(tmp_path, escape):
    canary = tmp_path / "canary"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(CheckpointError, match=r"chat template tried something its sandbox forbids .*replace it") as e:
        render(tmp_path, escape.replace("{canary}", str(canary)), messages)
    assert_one_line(e)
    assert not canary.exists() and messages == [{"role": "user", "content": "hi"}]


def test_raise_exception_refuses_the_messages(tmp_path):
    template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversation must start with a "
                "system message') }}{% endif %}ok")
    with pytest.raises(InvalidRequestError, match="chat template refuses these messages: Conversation must start "
                                                  "with a system message; change them as it asks") as e:
        render(tmp_path, template)
    assert_one_line(e)
    assert render(tmp_path, template, [{"role": "system", "content": "x"}]) == "ok"


def test_strftime_now(tmp_path):
    today = lambda: datetime.datetime.now().strftime("%d %b %Y")  # noqa: E731
    before = today()
    rendered = render(tmp_path, "Today Date: {{ strftime_now('%d %b %Y') }}")
    assert rendered in {f"Today Date: {before}", f"Today Date: {today()}"}  # either side of midnight


def test_tojson_is_transformers_tojson(tmp_path):
    """Plain json.dumps: no HTML escaping of <, > and &, non-ASCII kept, and its options work."""
    tools = [{"name": "add", "description": "a <b> & c — ü"}]
    template = ("{{ messages | tojson }}|{{ messages | tojson(indent=2) }}|"
                "{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}")
    assert render(tmp_path, template, tools) == \
        f"{json.dumps(tools, ensure_ascii=False)}|{json.dumps(tools, ensure_ascii=False, indent=2)}|" '{"a": 2, "b": 1}'


def test_helpers_real_templates_use(tmp_path):
    """Loop controls, namespace() and transformers' {% generation %} tag."""
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% set ns.n = ns.n + 1 %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}={{ ns.n }}")
    assert render(tmp_path, template, [{"role": "user", "content": c} for c in "abc"]) == "ab=2"


def test_named_templates_render_the_default_one(tmp_path):
    """tokenizer_config.json's chat_template as a list of named templates (transformers saves them
    so): chats use the one named "default", as transformers does; the list read as no template."""
    path = checkpoint(tmp_path / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    (tmp_path / "plain").mkdir()
    assert Tokenizer.load(path).chat_prompt(USER) == render(tmp_path / "plain", CHATML)
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named[:1]}))
    with pytest.raises(CheckpointError, match=r"a list of templates \(names: 'tool_use'\) with no 'default' one") as e:
        Tokenizer.load(path)
    assert_one_line(e)


def test_oversized_template_is_refused_at_load(tmp_path):
    with pytest.raises(CheckpointError, match=rf"chat_template.jinja is {MAX_TEMPLATE_BYTES + 1} bytes, more than the "
                                              "1 MiB a chat_template.jinja may be") as e:
        Tokenizer.load(checkpoint(tmp_path / "model", template_file="x" * (MAX_TEMPLATE_BYTES + 1)))
    assert_one_line(e)
    with pytest.raises(CheckpointError, match="over the"):
        Tokenizer.load(checkpoint(tmp_path / "other", template="x" * (MAX_TEMPLATE_BYTES + 1)))


def test_syntax_error_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"chat template does not parse \(line 2: ") as e:
        Tokenizer.load(checkpoint(tmp_path / "model", "ok\n{% for m in messages %}"))
    assert_one_line(e)


def test_rendered_prompt_is_bounded(tmp_path):
    template = "{% for i in range(99999) %}{% for j in range(99999) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequestError, match=f"exceeds {MAX_PROMPT_CHARS} characters"):
        render(tmp_path, template)


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(20) %}{% set ns.s = ns.s|replace('x', 'xxxxx') %}{% endfor %}"
    "{{ ns.s|length }}",
])
def test_values_grown_step_by_step_are_refused_before_they_exhaust_memory(tmp_path, template):
    """Doubling a string 40 times (by ~ or +) or replacing one character by five 20 times: each step
    is small, the 20th or 40th is terabytes. Before, only the output was bounded, after the fact."""
    with pytest.raises(CheckpointError, match="sandbox forbids .*exceeds the limit of 8388608") as e:
        render(tmp_path, template)
    assert_one_line(e)


S = "{% set s = 'x' * 1000000 %}{% set l = range(100000) | list %}"


@pytest.mark.parametrize("expression", [
    "[s, s, s, s, s, s, s, s, s] | join", "''.join([s, s] * 5)", "s.replace('x', 'xxxxxxxxx')", "'{}{}{}{}{}{}{}{}{}'.format(s, s, s, s, s, s, s, s, s)",
    "'%s%s%s%s%s%s%s%s%s' % (s, s, s, s, s, s, s, s, s)", "([s] * 100) | join", "s | replace('x', 10**100)",
    "[s] | replace('x', 'x' * 10)", "([l] * 100) | sum(start=[])", "'%8000000s%8000000s' % ('a', 'b')",
    "'{:8000000}{:8000000}'.format('a', 'b')", "[[s] * 100] * 100", "([s] * 100) | tojson", "([s] * 100) | string",
    "s ~ [s] * 10", "('\n' * 100000) | indent(100)", "dict(a=[s] * 10)", "([1] * 1000) | tojson(indent=8000000)",
    "('\t' * 1000).expandtabs(8000000)", "s.translate({120: 'xxxxxxxxx'})", "s.encode().replace('x'.encode(), s.encode())",
    "('%(a)s' * 150) % {'a': s}", "('{0}' * 150).format(s)", "('x ' * 150) | wordwrap(1, wrapstring=s)",
    "(('x',) * 30000,) * 30000", "[3 ** 2000] * 10000", "(3 ** 2000) * (3 ** 2000)",
])
def test_a_value_built_in_one_step_from_others_is_measured_first(tmp_path, expression):
    """Found by a review: join, format, % and replace of several long strings, a list of references
    to one long string joined, summed or printed. Each step is checked before it builds anything
    over the limit (here from a million-character string, or a list of 100,000 numbers)."""
    with pytest.raises(CheckpointError, match="sandbox forbids .*exceeds the limit of 8388608"):
        render(tmp_path, S + "{{ " + expression + " }}")


@pytest.mark.parametrize("expression", ["('x' * 8000000) | batch(1) | list | length", "('xy' * 4000000) | sort",
                                        "('x' * 8000000) | unique | list", "range(100000) | list | map('string') | list"])
def test_filters_that_walk_their_value_take_at_most_100000_items(tmp_path, expression):
    """Their work is library code, where the deadline cannot stop it (batch(1) of 8 million characters
    built 1.6 GB of lists, sort ran 17 s)."""
    expected = "filter was given" if "range" not in expression else None
    if expected is None:
        assert render(tmp_path, "{{ " + expression + " | length }}") == "100000"  # at the limit: fine
        return
    with pytest.raises(CheckpointError, match=f"sandbox forbids .*{expected} 8000000 items, over the limit of 100000"):
        render(tmp_path, "{{ " + expression + " }}")


def test_constant_filters_run_when_rendered_not_when_loaded(tmp_path):
    """Jinja folds filters of constants when it compiles, and the tokenizer compiles at load, out of
    the deadline: center(8000000) | batch(1) | batch(1) | list took 11 s and 1.6 GB in Tokenizer.load."""
    tokenizer = Tokenizer.load(checkpoint(tmp_path / "model", "{{ 'x' | center(8000000) | batch(1) | list }}"))
    with pytest.raises(CheckpointError, match="filter was given 8000000 items"):
        tokenizer.chat_prompt(USER)


def test_a_blocks_text_is_measured_before_it_is_joined(tmp_path):
    """{% set %}, macro and {% filter %} bodies are joined by Jinja's own concat: 200 references to an
    8-million-character string became 1.6 GB before."""
    for template in ("{% set x %}{% for i in range(200) %}{{ s }}{% endfor %}{% endset %}{{ x | length }}",
                     "{% macro m() %}{% for i in range(200) %}{{ s }}{% endfor %}{% endmacro %}{{ m() | length }}",
                     "{% filter upper %}{% for i in range(200) %}{{ s }}{% endfor %}{% endfilter %}"):
        with pytest.raises(CheckpointError, match="sandbox forbids .*the text of a block exceeds"):
            render(tmp_path, "{% set s = 'x' * 8000000 %}" + template)


def test_the_deadline_cannot_be_swallowed_by_a_library_frame(tmp_path, monkeypatch):
    """The tracer raised in whatever frame it was tracing: inside Jinja's `is sequence` test, whose
    `except Exception` swallowed the timeout, and the template then ran with no deadline at all."""
    monkeypatch.setattr("worker.chat_template.MAX_RENDER_SECONDS", 0.1)
    for padding in range(8):
        template = "{% for i in range(2000) %}{% for j in range(1000) %}" + "{% set a = 1 %}" * padding + \
                   "{% if u is sequence %}{% endif %}{% endfor %}{% endfor %}done"
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="ran for more than 0.1 s"):
            render(tmp_path, template)
        assert time.monotonic() - started < 5


def test_a_template_that_runs_too_long_is_stopped(tmp_path, monkeypatch):
    """Loops with an empty body build nothing a size bound catches: three nested range(100000) would
    run for days, on the engine's thread, for every request."""
    monkeypatch.setattr("worker.chat_template.MAX_RENDER_SECONDS", 0.5)
    loops = "{% for i in range(100000) %}{% for j in range(300) %}{% endfor %}{% endfor %}done"  # minutes
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"chat template ran for more than 0.5 s on these messages") as e:
        render(tmp_path, loops)
    assert_one_line(e)
    assert time.monotonic() - started < 10
    assert render(tmp_path, CHATML).endswith("<|im_start|>assistant\n")  # and a real one renders


def test_lipsum_is_not_there_and_ordinary_joins_still_work(tmp_path):
    with pytest.raises(CheckpointError, match="failed on these messages .*lipsum"):
        render(tmp_path, "{{ lipsum(n=100000) }}")
    assert render(tmp_path, "{{ 'a' ~ 1 ~ none ~ [2] }}|{{ 'ab' + 'c' }}|{{ ([1] + [2])|length }}|{{ 'aXa'|replace('a', 'bb') }}"
                  "|{{ 'aaa'|replace('a', 'bb', 2) }}") == "a1None[2]|abc|2|bbXbb|bbbba"


@pytest.mark.parametrize("expression", ["'x' * 10**10", "[0] * 10**10", "2 ** 100000", "(10**10) ** (10**10)",
                                        "'%9999999999d' % 1",
                                        "'%*d' % (10**10, 1)", "'x'.ljust(10**10)", "'x' | center(10**10)",
                                        "'x\ny' | indent(10**10)", "[1] | slice(10**10) | list",
                                        "'%10000000000s' | format('x')", "'{:>9999999999}'.format(1)",
                                        "'{0:>{1}}'.format(1, 10**10)", "'{:.9999999999f}'.format(1.5)",
                                        "'{a:>{b}}'.format_map({'a': 1, 'b': 10**10})"])
def test_huge_values_are_refused_before_they_are_built(tmp_path, expression):
    with pytest.raises(CheckpointError, match="sandbox forbids"):
        render(tmp_path, "{{ " + expression + " }}")


def test_other_failures_are_the_templates_fault(tmp_path):
    for template, kind in [("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ messages[5].content }}", "UndefinedError"),
                           ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError")]:
        with pytest.raises(CheckpointError, match=f"chat template failed on these messages \\({kind}: ") as e:
            render(tmp_path, template)
        assert_one_line(e)


def test_ordinary_numbers_and_formats_still_work(tmp_path):
    """The bounds refuse sizes, not values: big numbers print, %-formats with small widths work."""
    assert render(tmp_path, "{{ 1700000000 }} {{ '%d' % 1700000000 }} {{ '%5s|' % 'ab' }} {{ 2 ** 64 }} "
                            "{{ '{:,}'.format(1234567890) }} {{ '{0:>{1}}|'.format('a', 3) }}") == \
        "1700000000 1700000000    ab| 18446744073709551616 1,234,567,890   a|"


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_tokenizer_file_that_is_a_fifo_is_refused_not_read(tmp_path, name):
    """Reading a FIFO blocks until someone writes to it: the engine froze (tokenizer.json), or sat
    at "loading weights" for good (tokenizer_config.json)."""
    path = checkpoint(tmp_path / "model", CHATML, template_file="x")
    (path / name).unlink()
    os.mkfifo(path / name)
    with pytest.raises(CheckpointError, match=f"{name} is a FIFO \\(named pipe\\), not a regular file") as e:
        Tokenizer.load(path)
    assert_one_line(e)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_tokenizer_file_linking_out_of_the_checkpoint_is_refused_unless_allowed(tmp_path, name):
    """A chat template linked to a secret came back to any client in prompt_token_ids."""
    path = checkpoint(tmp_path / "model", CHATML, template_file=CHATML)
    outside = tmp_path / ("real-" + name)
    (path / name).rename(outside)
    (path / name).symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"{name} links to {outside}, outside the checkpoint directory"):
        Tokenizer.load(path)
    assert Tokenizer.load(path, allow_external=True).chat_prompt(USER).endswith("<|im_start|>assistant\n")


def test_a_tokenizer_file_swapped_for_a_link_after_its_check_is_refused(tmp_path, monkeypatch):
    """The link swapped in between the path's check and its open (a racing process) is caught
    where the file is opened."""
    import worker.tokenizer as tokenizer_module
    path = checkpoint(tmp_path / "model", CHATML, template_file=CHATML)
    outside = tmp_path / "real-tokenizer.json"
    shutil.copyfile(path / "tokenizer.json", outside)
    real = tokenizer_module.inside

    def racing(root, file, allow_external):
        checked = real(root, file, allow_external)
        if file.name == "tokenizer.json":
            file.unlink()
            file.symlink_to(outside)
        return checked

    monkeypatch.setattr(tokenizer_module, "inside", racing)
    with pytest.raises(CheckpointError, match=f"tokenizer.json links to {outside}, outside the checkpoint directory"):
        Tokenizer.load(path)


def test_special_tokens_are_strings_or_added_tokens(tmp_path):
    """What the template gets as bos_token and eos_token, as transformers gives them; anything else
    is refused at load (an 8M-item list went to the renderer with every chat request)."""
    path = checkpoint(tmp_path / "model", "{{ bos_token }}|{{ eos_token }}")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<s>", "lstrip": False, "__type": "AddedToken"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.load(path).chat_prompt(USER) == "<s>|<|im_end|>"
    for bad in ([1] * 1000, "x" * 1025, {"content": 7}):
        config["eos_token"] = bad
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match="eos_token must be a string"):
            Tokenizer.load(path)


def test_oversized_and_malformed_tokenizer_files_are_refused(tmp_path, monkeypatch):
    path = checkpoint(tmp_path / "model", CHATML)
    monkeypatch.setattr("worker.tokenizer.TOKENIZER_CONFIG_MAX_BYTES", 100)
    (path / "tokenizer_config.json").write_text(json.dumps({"pad": "x" * 200}))
    with pytest.raises(CheckpointError, match="tokenizer_config.json is 2.. bytes, more than the 100 bytes a tokenizer_config.json may be"):
        Tokenizer.load(path)
    monkeypatch.undo()
    for text, message in (("[1, 2]", "is not a JSON object"), ("{", "is not valid JSON"),
                          ("[" * 100_000, "is nested too deeply")):
        (path / "tokenizer_config.json").write_text(text)
        with pytest.raises(CheckpointError, match=f"tokenizer_config.json {message}") as e:
            Tokenizer.load(path)
        assert_one_line(e)


def test_encoding_lets_other_threads_run_and_gives_the_librarys_ids(default_model):
    """The batch call lets the GIL go (encode held it: an 8 Mi-character prompt stopped the engine's
    every other thread, /health's too, for 7 s); the ids are the library's encode's."""
    tokenizer = Tokenizer.load(default_model)
    library = tokenizers.Tokenizer.from_file(str(default_model / "tokenizer.json"))
    for text in ("", "hello", "The capital of France is", "naïve 日本語 🙂\n\n  x", "<|im_start|>user\nhi"):
        assert tokenizer.encode(text) == library.encode(text).ids
    text, ticks, done = "the quick brown fox jumps over the lazy dog. " * 20_000, [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        before = len(ticks)
        ids = tokenizer.encode(text)
        during = len(ticks) - before
    finally:
        done.set()
        ticker.join()
    assert len(ids) > 100_000 and during > 5, during  # with the GIL held: none, or the one under way


def test_a_panic_in_the_library_is_the_checkpoints_error_in_one_line(tmp_path, default_model):
    """A pre-tokenizer's regex past Oniguruma's retry limit panics in Rust: pyo3's PanicException,
    which no `except Exception` catches (a plain-text 500 and a traceback before)."""
    path = tmp_path / "model"
    path.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, path / name)
    spec = json.loads((default_model / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.load(path)
    assert tokenizer.encode("aab") == tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).encode("aab").ids
    with pytest.raises(CheckpointError, match="the checkpoint's tokenizer failed on this text") as e:
        tokenizer.encode("a" * 40 + "b")
    assert_one_line(e)
    with pytest.raises(InvalidRequestError, match="it is not valid Unicode"):
        tokenizer.encode("a\ud800b")


def test_a_step_that_expands_text_is_bounded(tmp_path, default_model):
    """A normalizer's Replace of 100,000 characters for one took an engine 9 MB a character of
    prompt: refused at load past 64, and what a prompt may hold shrinks by the expansion allowed."""
    path = tmp_path / "model"
    path.mkdir()
    spec = json.loads((default_model / "tokenizer.json").read_text())
    (path / "tokenizer.json").write_text(json.dumps(spec))
    assert Tokenizer.load(path).max_text_chars(2048) == 2048 * 256
    for content, ok in (("b" * 64, True), ("b" * 65, False)):
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Replace", "pattern": {"String": "æ"}, "content": content}]}
        (path / "tokenizer.json").write_text(json.dumps(spec))
        if ok:
            tokenizer = Tokenizer.load(path)
            assert tokenizer.expansion == 64 and tokenizer.max_text_chars(2048) == 2048 * 4
            assert len(tokenizer.encode("æ")) > 1
        else:
            with pytest.raises(CheckpointError, match="tokenizer.json's normalizer's Replace content is 65 characters, "
                                                      "over the 64 a step may put in place of what it matches"):
                Tokenizer.load(path)
    spec["normalizer"] = None
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"},
                                                         "content": " " * 1000}, spec["decoder"]]}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match="tokenizer.json's decoder's Replace content is 1000 characters"):
        Tokenizer.load(path)


def test_a_token_that_stands_for_too_much_text_is_refused_when_met(tmp_path):
    """A vocabulary entry of 32 MiB made an echo of 24 such tokens 805 MB and 4 GB of the engine's
    memory. Checked as tokens are first decoded (a scan of the vocabulary at load costs 25-45 ms)."""
    path = tmp_path / "model"
    path.mkdir()
    vocab = {"<unk>": 0, "hi": 1, "x" * 4097: 2, "y" * 4096: 3}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    tokenizer = Tokenizer.load(path)
    assert tokenizer.decode([1, 3]) == "hi " + "y" * 4096
    for call in (lambda: tokenizer.decode([1, 2]), lambda: tokenizer.token_bytes(2)):
        with pytest.raises(CheckpointError, match="token 2 of the checkpoint's tokenizer stands for 4097 characters, "
                                                  "over the 4096 one token may"):
            call()
