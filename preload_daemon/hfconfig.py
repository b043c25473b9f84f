"""config.json read as input: a regular file of bounded size holding a JSON object of bounded depth,
and its fields read with their types checked, so a bad config fails the load with a message naming
the field and the file, never a TypeError later. arch.ArchSpec builds on these."""

import json
import math
import os
import pathlib

from preload_daemon.errors import CheckpointError
from preload_daemon.safepath import read_regular, short_repr

CONFIG_MAX_BYTES = 4 << 20
JSON_MAX_DEPTH = 64  # real configs nest 3 or 4 levels
MAX_DIMENSION = 1 << 40
MAX_LAYERS = 4096
"""Most decoder (or MTP) layers a config may declare: a load lists every layer's tensor names first
(num_hidden_layers of 3,000,000 took a daemon 33 s and 2.7 GB to refuse; the largest models have ~100)."""


def read_config(directory: str | os.PathLike, within: pathlib.Path | None = None) -> dict:
    """A checkpoint's config.json: a regular file holding a JSON object of bounded size and depth (in
    `within`, if given: safepath.open_regular), or an error naming the fix."""
    path = pathlib.Path(directory) / "config.json"
    data = read_regular(path, CONFIG_MAX_BYTES, "a checkpoint directory needs the model's config.json next to its "
                                                "*.safetensors files", within)
    return parse_config(data, str(path))


def parse_config(data: bytes | str, source: str) -> dict:
    """config.json's text (from a file or a publishing client) as a JSON object of bounded size and
    depth: the daemon stores it and serialises it again, which a deeply nested one would not survive."""
    if len(data) > CONFIG_MAX_BYTES:
        raise CheckpointError(f"{source} is larger than {CONFIG_MAX_BYTES >> 20} MiB; that is no model config")
    config = load_json(data, source, "fix or re-export the config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: not a JSON object; fix or re-export the config")
    if _too_deep(config, JSON_MAX_DEPTH):
        raise CheckpointError(f"{source} is nested too deeply (over {JSON_MAX_DEPTH} levels of objects and arrays); "
                              "that is no model config")
    return config


def load_json(data: bytes | str, source: str, fix: str):
    """Parsed JSON, or a CheckpointError naming `source` and `fix`: malformed text, integers too long
    to convert and nesting that exhausts the parser's recursion are all the file's fault, never a
    RecursionError or ValueError for the caller."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{source} is nested too deeply to parse (JSON arrays or objects thousands of levels "
                              f"deep); {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers of more than 4300 digits
        raise CheckpointError(f"{source} is not valid JSON ({e}); {fix}") from None


def _too_deep(value, limit: int) -> bool:
    """Whether JSON `value` nests objects and arrays more than `limit` levels deep (iteratively:
    recursing would fail on exactly the values this looks for)."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def architecture_name(config: dict, source: str) -> str:
    """The model class config.json names ("" when it names none)."""
    archs = config.get("architectures")
    if archs is None or archs == []:
        return ""
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise CheckpointError(f"{source}: architectures must be a list of model class names, e.g. "
                              f"[\"LlamaForCausalLM\"], got {short_repr(archs)}")
    return archs[0]


def rope_config(config: dict, source: str, head_dim: int, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, the scaling dict or None for plain rope) of a config, read as transformers reads
    it: `rope_scaling` (the older name) over `rope_parameters`, rope_theta and partial_rotary_factor
    from that dict or else the top level, a top-level original_max_position_embeddings over the
    dict's (Phi-3 keeps it there). Every field the engine reads (kernels/rope.py) is checked, and
    the frequencies computed once, so that a bad or an unsupported rope fails the load, not the
    engine after it."""
    from kernels.rope import ROPE_TYPES, rope_type  # torch: not for the command line, which reads configs too
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise CheckpointError(f"{source}: {key} must be an object, got {type(config[key]).__name__}")
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope, where = config.get(key) or {}, f"{source} {key}"
    theta = float_field(rope, "rope_theta", where, float_field(config, "rope_theta", source, 10000.0))
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise CheckpointError(f"{source}: partial_rotary_factor {short_repr(partial)} is not supported (rope over "
                              "part of each head); only 1.0 is")
    kind = rope_type(rope)
    if not isinstance(kind, str):
        raise CheckpointError(f"{where}: rope_type must be a string such as \"llama3\", got {short_repr(kind)}")
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{where}: rope_type {short_repr(kind)} is not supported; the engine computes "
                              f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        _check_frequencies(head_dim, theta, None, where)
        return theta, None
    scaling = {**rope, "rope_type": kind}
    if kind in ("llama3", "yarn") and config.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", max_positions)
    int_field(scaling, "original_max_position_embeddings", where)
    scaling["factor"] = float_field(scaling, "factor", where, None)
    if kind == "llama3":
        low, high = (float_field(scaling, k, where, None) for k in ("low_freq_factor", "high_freq_factor"))
        if low == high:
            raise CheckpointError(f"{where}: low_freq_factor and high_freq_factor are both {low}; llama3 scaling "
                                  "needs them apart")
    if kind == "yarn":
        for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if name != "attention_factor" and scaling.get(name) == 0 and not isinstance(scaling[name], bool):
                scaling[name] = None  # 0 stands for "absent" here, as in transformers
            elif scaling.get(name) is not None:
                scaling[name] = float_field(scaling, name, where, None)
        if scaling.get("truncate") is not None and not isinstance(scaling["truncate"], bool):
            raise CheckpointError(f"{where}: truncate must be true or false, got {short_repr(scaling['truncate'])}")
    _check_frequencies(head_dim, theta, scaling, where)
    return theta, scaling


def _check_frequencies(head_dim: int, theta: float, scaling: dict | None, where: str) -> None:
    """Each field in range can still make no frequencies (rope_theta 1 divides by log 1 in yarn; one
    of 1e-300 is 0 in float32)."""
    from kernels.rope import attention_factor, inv_freq
    problem = ""
    try:
        freqs, scale = inv_freq(head_dim, theta, scaling), attention_factor(scaling)
        if not bool(freqs.isfinite().all()) or not 0 < scale < math.inf:
            problem = "infinite or undefined values"
    except (ArithmeticError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem:
        kind = f"{scaling['rope_type']} scaling" if scaling else "rope"
        raise CheckpointError(f"{where}: {kind} with rope_theta {theta:g} and these fields computes no frequencies "
                              f"({problem}); fix the config")


def eos_field(config: dict, source: str, fix: str = "") -> tuple[int, ...]:
    """eos_token_id: an integer or a list of them (config.json's, generation_config.json's), or ()."""
    eos = config.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        raise CheckpointError(f"{source}: eos_token_id must be an integer or a list of integers, got "
                              f"{short_repr(eos)}{f'; {fix}' if fix else ''}")
    return tuple(eos)


def int_field(config: dict, key: str, source: str, default: int | None = None, minimum: int = 1,
              maximum: int = MAX_DIMENSION) -> int:
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise CheckpointError(f"{source}: missing field {key!r}; a {key} is needed to lay out the weights")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointError(f"{source}: {key} must be an integer >= {minimum}, got {short_repr(value)}")
    if value > maximum:
        limit = "2**40" if maximum == MAX_DIMENSION else f"{maximum:,}"
        raise CheckpointError(f"{source}: {key}={value} is more than {limit}; that is no real model's {key}")
    return value


def float_field(config: dict, key: str, source: str, default: float | None) -> float:
    value = config.get(key)
    value = default if value is None else value
    # An int (not a bool) as a float; float() of one of 400 digits would raise.
    number = float(value) if type(value) is int and value.bit_length() <= 1024 else value
    if not isinstance(number, float) or not 0 < number < math.inf:
        raise CheckpointError(f"{source}: {key} must be a positive finite number, got {short_repr(value)}")
    return number


def bool_field(config: dict, key: str, source: str) -> bool:
    """A true/false field, absent or null meaning false: a string "false" would otherwise count as true."""
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key} must be true or false, got {short_repr(value)}")
    return value is True
