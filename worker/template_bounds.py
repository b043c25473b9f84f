"""The size bounds of a chat template's sandbox (worker/chat_template.py): no step of a template may
build a string or a list over MAX_PROMPT_CHARS, checked before the step runs wherever one step can
multiply what it is given ('x' * 10**10, '%9999999999d' % 1, [s] * 100 | join, s | replace('x',
'xxxx') in a loop, '{}{}'.format(s, s), [[s] * 100] * 100 printed), so that memory and CPU never
go to a value the output bound would refuse after the fact.

A list holds references: [s] * 100 is a list of 100 however long s is. Its size shows when it is
turned into text (printed, ~, join, tojson, string, format, %), so those measure what they are
given with `weight` (characters of text in it, with an early exit)."""

import re

import jinja2.sandbox

MAX_PROMPT_CHARS = 8 << 20
"""Largest rendered chat prompt, and largest string or list the template may build on the way."""
MAX_POWER_BITS = 4096
"""Largest integer `**` may build (in bits): 2 ** 10**10 would take the CPU and memory for good."""
SIZED_METHODS = frozenset(("center", "ljust", "rjust", "zfill", "expandtabs"))
"""str methods whose integer argument is the length of the string they build."""
MAX_ITEMS = 100_000
"""Most items a filter that walks its value item by item may be given (a chat's messages are a few
hundred; batch(1) of 8 million characters built 1.6 GB of lists in library code, where the
deadline cannot stop it)."""
ITEM_FILTERS = frozenset(("batch", "slice", "sort", "unique", "groupby", "map", "select", "reject", "selectattr",
                          "rejectattr", "list", "dictsort", "min", "max", "sum", "join", "reverse", "random"))
TEXT_FILTERS = frozenset(("tojson", "string", "pprint", "urlencode", "xmlattr", "e", "escape", "forceescape", "safe"))
"""Filters that turn their value into text (whose size is the value's weight)."""
_FORMAT_FIELD = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")
_FORMAT_WIDTHS = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")


def refuse(what: str) -> None:
    raise jinja2.sandbox.SecurityError(f"{what} exceeds the limit of {MAX_PROMPT_CHARS}")


def weight(value, budget: int = MAX_PROMPT_CHARS) -> int:
    """About the characters `value` becomes as text: a string's length, a container's items' weights
    (each at least 1); stops counting once past `budget` (a list of a million references to one
    long string is light to hold and huge to print)."""
    total, stack = 0, [value]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 2 + len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + len(item)
            stack.extend(item)
        elif isinstance(item, jinja2.utils.Namespace):
            stack.append(dict(item._Namespace__attrs))  # noqa: SLF001 (Jinja keeps its attributes there)
        elif isinstance(item, int):
            total += 2 + item.bit_length() * 30103 // 100000  # its decimal digits
        else:
            total += 24  # a float, None, an undefined
    return total


def check_weight(*values, what: str = "a value turned into text") -> None:
    if weight(values) > MAX_PROMPT_CHARS:
        refuse(what)


def check_sizes(args, kwargs) -> None:
    """Refuses integer arguments beyond MAX_PROMPT_CHARS: as widths or counts they would build huge values."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > MAX_PROMPT_CHARS:
            refuse(f"the argument {value}")


def check_items(value, name: str) -> None:
    if hasattr(value, "__len__") and len(value) > MAX_ITEMS:
        raise jinja2.sandbox.SecurityError(f"the {name} filter was given {len(value)} items, over the limit of "
                                           f"{MAX_ITEMS}")


def check_result(value) -> None:
    """What one step built: a string or list over the limit is refused before the next step uses it."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_PROMPT_CHARS:
        refuse(f"a {type(value).__name__} of length {len(value)}")


def check_repeat(sequence, times) -> None:
    """`s * n`, and `[a] * n` of a long `a` (a list of references: huge to print, compare or hash),
    and `a * b` of integers (their bits add up)."""
    if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(times, int) \
            and max(weight(sequence), len(sequence)) * times > MAX_PROMPT_CHARS:
        refuse(f"repeating a {type(sequence).__name__} of length {len(sequence)} {times} times")
    if isinstance(sequence, int) and isinstance(times, int) and sequence.bit_length() + times.bit_length() > MAX_POWER_BITS:
        refuse(f"multiplying integers of {sequence.bit_length()} and {times.bit_length()} bits")


def check_power(base, exponent) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and base.bit_length() * exponent > MAX_POWER_BITS:
        raise jinja2.sandbox.SecurityError(f"{base} ** {exponent} is too large a number")


def check_add(left, right) -> None:
    """`a + b` of strings, lists or tuples (doubling by + builds 2**40 in 40 steps)."""
    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
            and len(left) + len(right) > MAX_PROMPT_CHARS:
        refuse(f"adding a {type(left).__name__} of length {len(left)} and one of {len(right)}")


def check_join(items, separator) -> list:
    """join's items (materialized, once) after checking the text they make."""
    items = list(items)
    if len(items) > MAX_PROMPT_CHARS:
        refuse(f"joining {len(items)} items")
    if weight(items) + weight(separator) * max(len(items) - 1, 0) > MAX_PROMPT_CHARS:
        refuse("joining these items")
    return items


def check_replace(value, old, new, count=None) -> None:
    """str(value).replace(str(old), str(new), count), as Jinja's filter and str's method make it."""
    check_weight(value, old, new, what="replace's arguments")
    if not (isinstance(value, bytes) and isinstance(old, bytes) and isinstance(new, bytes)):
        value, old, new = str(value), str(old), str(new)
    if len(new) > len(old):
        times = value.count(old) if old else len(value) + 1
        if isinstance(count, int) and count >= 0:
            times = min(times, count)
        if len(value) + times * (len(new) - len(old)) > MAX_PROMPT_CHARS:
            refuse("the string replace would build")


def check_method(owner, name: str, args, kwargs) -> tuple:
    """A call of a str (or bytes) method: the methods whose result can outgrow their string many
    times over are measured first; returns the arguments to call it with (join's materialized)."""
    if name in SIZED_METHODS:
        check_sizes(args, kwargs)
        if name == "expandtabs":  # each tab becomes up to `tabsize` spaces
            size = (args or (kwargs.get("tabsize", 8),))[0]
            if isinstance(size, int) and len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * size \
                    > MAX_PROMPT_CHARS:
                refuse("the string expandtabs would build")
    elif name == "join" and args:
        args = (check_join(args[0], owner), *args[1:])
    elif name == "replace" and len(args) >= 2:
        check_replace(owner, *args[:3])
    elif name == "translate" and args:  # each character may become a long string
        longest = max((weight(v) for v in args[0].values()), default=0) if isinstance(args[0], dict) else 1
        if len(owner) * max(longest, 1) > MAX_PROMPT_CHARS:
            refuse("the string translate would build")
    return args


def check_tojson(value, indent) -> None:
    """tojson(indent=N) puts N spaces (or the string N) before every item of every level."""
    size = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if weight(value) * (1 + max(size, 0)) > MAX_PROMPT_CHARS:
        refuse("the JSON text tojson would build")


def check_concat(pieces: list) -> str:
    """The text of a block ({% set %}...{% endset %}, a macro, {% filter %}), measured before it is
    joined: a loop of {{ s }} holds 200 references to one long string in the pieces."""
    if sum(map(len, pieces)) > MAX_PROMPT_CHARS:
        refuse("the text of a block")
    return "".join(pieces)


def check_wordwrap(value, width, wrapstring) -> None:
    lines = len(str(value)) // max(width if isinstance(width, int) else 1, 1) + 1
    if len(str(value)) + lines * weight(wrapstring) > MAX_PROMPT_CHARS:
        refuse("the wrapped string")


def check_indent(value, width) -> None:
    lines = str(value).count("\n") + 1
    if len(str(value)) + lines * (width if isinstance(width, int) else len(str(width))) > MAX_PROMPT_CHARS:
        refuse("the indented string")


def check_sum(items, start=0) -> list:
    """sum of lists or strings builds their concatenation."""
    items = list(items)
    sized = [len(i) for i in (*items, start) if isinstance(i, (str, list, tuple))]
    if sum(sized) > MAX_PROMPT_CHARS:
        refuse("the sum of these lists")
    return items


def check_percent(text: str, values) -> None:
    """'%10000000000d' % 1, or twenty '%8000000s', builds gigabytes: refuse when the widths and
    precisions in the format (or, for '%*d', among the values) and the values' text add up past the
    limit."""
    fields = _FORMAT_WIDTHS.findall(text)
    total = len(text) + len(fields) * weight(values)  # a field may print any of the values: '%(a)s' * 150
    for width, precision in fields:
        if len(width) > 9 or len(precision) > 9:
            refuse(f"a %-format width or precision in {text[:40]!r}")
        total += int(width or 0) + int(precision or 0)
    if total > MAX_PROMPT_CHARS:
        refuse(f"the %-format {text[:40]!r} with these values")
    if "*" in text:
        check_sizes(values if isinstance(values, tuple) else (values,), {})


def check_format(text: str, args, kwargs) -> None:
    """'{:>9999999999}'.format(1) or '{}{}'.format(s, s): the fields' widths and precisions (a width
    taken from the arguments, '{0:>{1}}', among them) and the arguments' text, added up."""
    fields = _FORMAT_FIELD.findall(text)
    total = len(text) + len(fields) * (weight(args) + weight(kwargs))  # '{0}' * 150 prints one 150 times
    for field in fields:
        spec = field.partition(":")[2]
        numbers = re.findall(r"\d+", spec)
        if any(len(n) > 9 for n in numbers):
            refuse(f"a width or precision in {field[:40]!r}")
        total += sum(map(int, numbers))
        if "{" in spec:
            mappings = [a for a in args if isinstance(a, dict)]  # format_map's argument
            check_sizes((*args, *(v for m in mappings for v in m.values())), kwargs)
    if total > MAX_PROMPT_CHARS:
        refuse(f"formatting {text[:40]!r} with these arguments")
