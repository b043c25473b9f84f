"""A corpus of malformed checkpoints against one real daemon: each is refused with a specific error
that names the file (and tensor) and the fix, never INTERNAL, a traceback or a blocked thread, and
the model loaded before stays listed with the same content digest. Each case is a copy of a tiny
valid Llama checkpoint, then broken one way."""

import json
import os
import pathlib
import re
import shutil
import socket
import struct
import tempfile

import pytest

from preload_daemon.checkpoint import Checkpoint, stat_identity
from preload_daemon.errors import CheckpointError, InvalidRequestError, PlanError
from preload_daemon.plan import LoadSpec
from tests.conftest import DaemonHandle

LOAD_TIMEOUT = 15  # a case that blocks the daemon (a FIFO read) fails here instead of hanging
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
Q1 = "model.layers.1.self_attn.q_proj.weight"


# -- the daemon and the good model, once for the module ------------------------------------------------


@pytest.fixture(scope="module")
def daemon():
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
    handle = DaemonHandle(runtime)
    yield handle
    handle.stop()
    shutil.rmtree(handle.config.shm_dir, ignore_errors=True)
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def good(daemon, tiny_llama) -> tuple[str, str]:
    """(name, content digest) of the model every case must leave alone."""
    info = daemon.client.load(LoadSpec(path=str(tiny_llama)), timeout=60)
    return info.name, info.key.content_digest


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("bad")


# -- building broken checkpoints ------------------------------------------------------------------------


def split(raw: bytes) -> tuple[dict, bytes]:
    """(header, data section) of a safetensors file's bytes."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: dict | bytes, data: bytes, header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def edit_header(d: pathlib.Path, edit) -> None:
    """Rewrites d/model.safetensors with edit(header) applied (the data section unchanged)."""
    header, data = split((d / WEIGHTS).read_bytes())
    edit(header)
    (d / WEIGHTS).write_bytes(join(header, data))


def edit_config(d: pathlib.Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))


def write_index(d: pathlib.Path, **overrides) -> None:
    """An index that maps every tensor to model.safetensors, with `overrides` (tensor -> file)."""
    header, _ = split((d / WEIGHTS).read_bytes())
    weight_map = {name: WEIGHTS for name in header if name != "__metadata__"}
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {**weight_map, **overrides}}))


def replace_with(d: pathlib.Path, name: str, make) -> None:
    """d/name removed, then made again by make(path): a FIFO, a directory, a symlink..."""
    (d / name).unlink()
    make(d / name)


def bind_socket(path: pathlib.Path) -> None:
    """A Unix socket at `path`, bound through /proc/self/fd: socket paths are limited to 108 bytes."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


def link_outside(d: pathlib.Path, name: str) -> None:
    """d/name moved next to d (outside the checkpoint), and a symlink to it left in its place."""
    target = d.parent / f"{d.name}-outside-{name}"
    (d / name).rename(target)
    (d / name).symlink_to(target)


def extra_file(d: pathlib.Path, name: str) -> None:
    """A valid safetensors file holding one tensor, "extra"."""
    (d / name).write_bytes(join({"extra": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


# -- the corpus: (name, breaks a good copy in place, expected error class, message substring) ------------

EXTERNAL = "outside the checkpoint directory"
FLAG = "pass --allow-external-links to `preload daemon`/`preload serve`"

CASES = [
    # safetensors headers
    ("header-len-huge", lambda d: (d / WEIGHTS).write_bytes(join(b"{}", b"", 1 << 40)), CheckpointError,
     f"{WEIGHTS}: header length 1099511627776 exceeds the"),
    ("header-len-past-end", lambda d: (d / WEIGHTS).write_bytes(join(b"{}", b"\0" * 16, 5000)), CheckpointError,
     f"{WEIGHTS}: header length 5000 runs past the end"),
    ("header-too-short", lambda d: (d / WEIGHTS).write_bytes(b"\x01\x02"), CheckpointError,
     f"{WEIGHTS}: truncated: 2 bytes"),
    ("header-not-json", lambda d: (d / WEIGHTS).write_bytes(join(b"\xff\xfe{nope", b"")), CheckpointError,
     f"{WEIGHTS}: header is not valid JSON"),
    ("header-a-list", lambda d: (d / WEIGHTS).write_bytes(join(b"[1, 2]", b"")), CheckpointError,
     f"{WEIGHTS}: header is not a JSON object"),
    ("header-nested-100k", lambda d: (d / WEIGHTS).write_bytes(join(deep(100_000).encode(), b"")), CheckpointError,
     f"{WEIGHTS}: header is nested too deeply"),
    ("header-5000-digit-int", lambda d: (d / WEIGHTS).write_bytes(join(b'{"t": ' + b"1" * 5000 + b"}", b"")),
     CheckpointError, f"{WEIGHTS}: header is not valid JSON (Exceeds the limit"),
    ("header-metadata-nested", lambda d: edit_header(d, lambda h: h.update(__metadata__={"a": {"b": [1]}})),
     CheckpointError, f"{WEIGHTS}: __metadata__ must be an object of strings"),
    ("entry-not-object", lambda d: edit_header(d, lambda h: h.update({Q1: [1, 2]})), CheckpointError,
     f"tensor '{Q1}': entry needs dtype, shape and data_offsets"),
    ("dtype-unknown", lambda d: edit_header(d, lambda h: h[Q1].update(dtype="F33")), CheckpointError,
     f"tensor '{Q1}': unknown dtype 'F33'"),
    ("dtype-a-list", lambda d: edit_header(d, lambda h: h[Q1].update(dtype=["F32"])), CheckpointError,
     f"tensor '{Q1}': unknown dtype ['F32']"),
    ("shape-bool", lambda d: edit_header(d, lambda h: h[Q1].update(shape=[True, 64])), CheckpointError,
     f"tensor '{Q1}': shape [True, 64] is not a list of non-negative integers"),
    ("shape-negative", lambda d: edit_header(d, lambda h: h[Q1].update(shape=[-64, -64])), CheckpointError,
     "is not a list of non-negative integers"),
    ("shape-size-mismatch", lambda d: edit_header(d, lambda h: h[Q1].update(shape=[64, 65])), CheckpointError,
     f"tensor '{Q1}': shape [64, 65] x F32 is 16640 bytes but data_offsets span 16384"),
    ("offsets-past-end", lambda d: edit_header(d, lambda h: h[Q1].update(data_offsets=[1 << 40, (1 << 40) + 16384])),
     CheckpointError, f"tensor '{Q1}': data_offsets [1099511627776, 1099511644160] fall outside"),
    ("offsets-reversed", lambda d: edit_header(d, lambda h: h[Q1].update(data_offsets=h[Q1]["data_offsets"][::-1])),
     CheckpointError, "fall outside"),
    ("offsets-bools", lambda d: edit_header(d, lambda h: h[Q1].update(data_offsets=[False, True])), CheckpointError,
     f"tensor '{Q1}': data_offsets [False, True] is not a pair of integers"),
    ("offsets-overlap", lambda d: edit_header(d, lambda h: h["lm_head.weight"].update(
        data_offsets=h["model.embed_tokens.weight"]["data_offsets"])), CheckpointError, "overlap in the data section"),
    ("shape-product-huge", lambda d: edit_header(d, lambda h: h[Q1].update(shape=[1 << 62] * 100)), CheckpointError,
     f"tensor '{Q1}': shape [4611686018427387904, 4611686018427387904, "),
    ("file-truncated", lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:5000]), CheckpointError,
     "(truncated file?)"),
    # dtypes, shapes and tensors against config.json (refused when the plan is built)
    ("linear-stored-as-int32", lambda d: edit_header(d, lambda h: h[Q1].update(dtype="I32")), CheckpointError,
     f"tensor '{Q1}' is stored as int32, but a linear weight must be float16"),
    ("norm-stored-as-uint32", lambda d: edit_header(d, lambda h: h["model.norm.weight"].update(dtype="U32")),
     CheckpointError, "tensor 'model.norm.weight' is stored as uint32, but a norm weight must be float16"),
    ("fp8-without-quantization-config", lambda d: edit_header(d, lambda h: h[Q1].update(
        dtype="F8_E4M3", data_offsets=[h[Q1]["data_offsets"][0], h[Q1]["data_offsets"][0] + 4096])), CheckpointError,
     f"tensor '{Q1}' is stored as float8_e4m3fn, but a linear weight must be"),
    ("shape-transposed", lambda d: edit_header(d, lambda h: h["model.layers.0.self_attn.k_proj.weight"].update(
        shape=[64, 32])), CheckpointError,
     "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 32] but config.json implies [32, 64]"),
    ("missing-layer-q-proj", lambda d: edit_header(d, lambda h: h.pop(Q1)), CheckpointError,
     f"({WEIGHTS}): 1 tensor(s) that config.json needs are missing, e.g. {Q1}"),
    ("unknown-tensor", lambda d: edit_header(d, lambda h: h.update(
        {"model.layers.0.mlp.router.weight": h.pop(Q1)})), CheckpointError,
     "tensor(s) of no kind LlamaForCausalLM has, e.g. model.layers.0.mlp.router.weight"),
    # untrusted strings are cut short in messages: gRPC refuses status details over 16 KiB
    ("tensor-name-100k", lambda d: edit_header(d, lambda h: h.update({"y" * 100_000: h.pop(Q1)})), CheckpointError,
     "tensor(s) of no kind LlamaForCausalLM has, e.g. yyyyyyyy"),
    ("layer-number-5000-digits", lambda d: edit_header(d, lambda h: h.update(
        {f"model.layers.{'1' * 5000}.self_attn.q_proj.weight": h.pop(Q1)})), CheckpointError,
     "tensor(s) of no kind LlamaForCausalLM has, e.g. model.layers.1111"),
    ("shape-10k-dims", lambda d: edit_header(d, lambda h: h[Q1].update(shape=[1] * 10_000 + [64, 64])),
     CheckpointError, f"tensor '{Q1}' has shape [1, 1, 1, "),
    ("config-architecture-100k", lambda d: edit_config(d, architectures=["A" * 100_000]), PlanError,
     "config.json: architecture 'AAAAAAAA"),
    ("config-torch-dtype-100k", lambda d: edit_config(d, torch_dtype="T" * 100_000, dtype=None), CheckpointError,
     "config.json: torch_dtype 'TTTTTTTT"),
    ("config-rope-type-a-list", lambda d: edit_config(d, rope_parameters={"rope_type": ["llama3"]}),
     CheckpointError, "config.json rope_parameters: rope_type must be a string"),
    ("config-rope-factor-a-string", lambda d: edit_config(d, rope_parameters={
        "rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4}), CheckpointError,
     "config.json rope_parameters: factor must be a positive finite number, got '8'"),
    ("config-rope-type-dynamic", lambda d: edit_config(d, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     CheckpointError, "rope_type 'dynamic' is not supported; the engine computes default, linear, llama3, yarn"),
    ("config-rope-scaling-longrope", lambda d: edit_config(
        d, rope_parameters=None, rope_scaling={"type": "longrope", "factor": 2.0}),
     CheckpointError, "config.json rope_scaling: rope_type 'longrope' is not supported"),
    ("config-rope-linear-no-factor", lambda d: edit_config(d, rope_parameters={"rope_type": "linear"}),
     CheckpointError, "config.json rope_parameters: factor must be a positive finite number, got None"),
    ("config-rope-yarn-beta-a-string", lambda d: edit_config(d, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}), CheckpointError,
     "config.json rope_parameters: beta_fast must be a positive finite number, got '32'"),
    ("config-rope-yarn-truncate-a-string", lambda d: edit_config(d, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "truncate": "no"}), CheckpointError,
     "config.json rope_parameters: truncate must be true or false, got 'no'"),
    ("config-rope-partial-rotary", lambda d: edit_config(d, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}), CheckpointError,
     "partial_rotary_factor 0.5 is not supported"),
    ("config-rope-partial-rotary-top-level", lambda d: edit_config(d, partial_rotary_factor=0.5), CheckpointError,
     "config.json: partial_rotary_factor 0.5 is not supported"),
    # Each field in range, and still no rope: yarn divides by log(rope_theta), and takes the log of
    # the original length over the betas' rotations (the engine failed after the load on these).
    ("config-rope-yarn-theta-1", lambda d: edit_config(d, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1}), CheckpointError,
     "config.json rope_parameters: yarn scaling with rope_theta 1 and these fields computes no frequencies "
     "(ZeroDivisionError"),
    ("config-rope-yarn-beta-1e308", lambda d: edit_config(d, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_slow": 1e308}), CheckpointError,
     "computes no frequencies (ValueError"),
    ("config-rope-theta-1e-300", lambda d: edit_config(d, rope_parameters=None, rope_theta=1e-300), CheckpointError,
     "config.json rope_parameters: rope with rope_theta 1e-300 and these fields computes no frequencies (infinite"),
    ("config-rope-factor-400-digits", lambda d: edit_config(d, rope_parameters={
        "rope_type": "linear", "factor": 10 ** 400}), CheckpointError,
     "config.json rope_parameters: factor must be a positive finite number, got 1000000"),
    ("config-rope-llama3-equal-factors", lambda d: edit_config(d, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}), CheckpointError,
     "low_freq_factor and high_freq_factor are both 2.0"),
    # config.json
    ("config-missing", lambda d: (d / "config.json").unlink(), CheckpointError, "config.json is missing"),
    ("config-not-json", lambda d: (d / "config.json").write_text("{'hidden_size': 64}"), CheckpointError,
     "config.json is not valid JSON"),
    ("config-a-list", lambda d: (d / "config.json").write_text("[]"), CheckpointError,
     "config.json: not a JSON object"),
    ("config-nested-100k", lambda d: (d / "config.json").write_text('{"x": ' + deep(100_000) + "}"), CheckpointError,
     "config.json is nested too deeply to parse"),
    ("config-nested-100", lambda d: edit_config(d, x=json.loads(deep(100))), CheckpointError,
     "config.json is nested too deeply (over 64 levels"),
    ("config-too-large", lambda d: edit_config(d, padding="x" * (5 << 20)), CheckpointError,
     "MiB a config.json may be"),
    ("config-heads-a-string", lambda d: edit_config(d, num_attention_heads="4"), CheckpointError,
     "config.json: num_attention_heads must be an integer >= 1, got '4'"),
    ("config-hidden-zero", lambda d: edit_config(d, hidden_size=0), CheckpointError,
     "config.json: hidden_size must be an integer >= 1, got 0"),
    ("config-vocab-negative", lambda d: edit_config(d, vocab_size=-256), CheckpointError,
     "config.json: vocab_size must be an integer >= 1, got -256"),
    ("config-layers-float", lambda d: edit_config(d, num_hidden_layers=2.0), CheckpointError,
     "config.json: num_hidden_layers must be an integer >= 1, got 2.0"),
    ("config-layers-millions", lambda d: edit_config(d, num_hidden_layers=3_000_000), CheckpointError,
     "config.json: num_hidden_layers=3000000 is more than 4,096; that is no real model's num_hidden_layers"),
    ("config-mtp-layers-millions", lambda d: edit_config(d, num_nextn_predict_layers=10**9), CheckpointError,
     "config.json: num_nextn_predict_layers=1000000000 is more than 4,096"),
    ("config-kv-heads-not-dividing", lambda d: edit_config(d, num_key_value_heads=3), CheckpointError,
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("config-head-dim-odd", lambda d: edit_config(d, head_dim=45), CheckpointError,
     "config.json: head_dim=45 is odd; rotary embeddings turn pairs"),  # (the engine failed in its kernels)
    ("config-tie-a-string", lambda d: edit_config(d, tie_word_embeddings="false"), CheckpointError,
     "config.json: tie_word_embeddings must be true or false, got 'false'"),
    ("config-architectures-a-string", lambda d: edit_config(d, architectures="LlamaForCausalLM"), CheckpointError,
     "config.json: architectures must be a list of model class names"),
    ("config-quantization-a-list", lambda d: edit_config(d, quantization_config=["fp8"]), CheckpointError,
     "config.json: quantization_config must be an object"),
    ("config-eps-infinite", lambda d: edit_config(d, rms_norm_eps=float("inf")), CheckpointError,
     "config.json: rms_norm_eps must be a positive finite number, got inf"),
    # model.safetensors.index.json
    ("index-not-json", lambda d: (d / INDEX).write_text("{"), CheckpointError, f"{INDEX} is not valid JSON"),
    ("index-nested-100k", lambda d: (d / INDEX).write_text(deep(100_000)), CheckpointError,
     f"{INDEX} is nested too deeply"),
    ("index-weight-map-a-list", lambda d: (d / INDEX).write_text('{"weight_map": []}'), CheckpointError,
     f"{INDEX}: no weight_map object"),
    ("index-dot-dot", lambda d: write_index(d, **{Q1: f"../{d.name}/{WEIGHTS}"}), CheckpointError,
     f"{INDEX}: weight_map['{Q1}'] = '../{{name}}/{WEIGHTS}' leaves the checkpoint directory with '..'"),
    ("index-absolute", lambda d: write_index(d, **{Q1: str(d / WEIGHTS)}), CheckpointError,
     f"{WEIGHTS}' is an absolute path; an index may only name files in its own directory"),
    ("index-nul", lambda d: write_index(d, **{Q1: "model\0.safetensors"}), CheckpointError,
     f"{INDEX}: weight_map['{Q1}'] = 'model\\x00.safetensors' contains a NUL byte"),
    ("index-not-a-string", lambda d: write_index(d, **{Q1: 7}), CheckpointError,
     f"weight_map['{Q1}'] = 7 is not a file name"),
    ("index-file-missing", lambda d: write_index(d, **{Q1: "model-2.safetensors"}), CheckpointError,
     f"{INDEX} names files that do not exist: model-2.safetensors"),
    ("index-wrong-file", lambda d: (extra_file(d, "extra.safetensors"), write_index(d, **{Q1: "extra.safetensors"})),
     CheckpointError, f"{INDEX} places tensor '{Q1}' in extra.safetensors, but that file does not hold it"),
    ("tensor-in-two-files", lambda d: (shutil.copyfile(d / WEIGHTS, d / "copy.safetensors"),
                                       write_index(d, **{Q1: "copy.safetensors"})), CheckpointError,
     "tensor 'lm_head.weight' appears in both copy.safetensors and model.safetensors"),
    # special files where a regular file belongs
    ("weights-fifo", lambda d: replace_with(d, WEIGHTS, os.mkfifo), CheckpointError,
     f"{WEIGHTS} is a FIFO (named pipe), not a regular file"),
    ("config-fifo", lambda d: replace_with(d, "config.json", os.mkfifo), CheckpointError,
     "config.json is a FIFO (named pipe), not a regular file"),
    ("index-fifo", lambda d: os.mkfifo(d / INDEX), CheckpointError, f"{INDEX} is a FIFO (named pipe)"),
    ("weights-directory", lambda d: replace_with(d, WEIGHTS, os.mkdir), CheckpointError,
     f"{WEIGHTS} is a directory, not a regular file"),
    ("config-directory", lambda d: replace_with(d, "config.json", os.mkdir), CheckpointError,
     "config.json is a directory, not a regular file"),
    ("weights-socket", lambda d: replace_with(d, WEIGHTS, bind_socket), CheckpointError,
     f"{WEIGHTS} is a socket, not a regular file"),
    ("path-is-a-fifo", lambda d: (shutil.rmtree(d), os.mkfifo(d)), CheckpointError, "not a directory"),
    ("path-is-a-link-loop", lambda d: (shutil.rmtree(d), d.symlink_to(d)), CheckpointError,
     "cannot open (Too many levels of symbolic links); pass a Hugging Face checkpoint directory"),
    # symlinks
    ("weights-link-to-dev-zero", lambda d: replace_with(d, WEIGHTS, lambda p: p.symlink_to("/dev/zero")),
     CheckpointError, f"{WEIGHTS} links to /dev/zero, {EXTERNAL}"),
    ("weights-link-outside", lambda d: link_outside(d, WEIGHTS), CheckpointError, FLAG),
    ("config-link-outside", lambda d: link_outside(d, "config.json"), CheckpointError,
     f"config.json links to {{dir}}-outside-config.json, {EXTERNAL}"),
    ("weights-link-loop", lambda d: replace_with(d, WEIGHTS, lambda p: p.symlink_to(p)), CheckpointError,
     f"{WEIGHTS}: cannot read (Too many levels of symbolic links)"),
    ("weights-link-dangling", lambda d: replace_with(d, WEIGHTS, lambda p: p.symlink_to("gone.safetensors")),
     CheckpointError, f"{WEIGHTS} is missing"),
]


@pytest.mark.parametrize("name, breaks, error, message", CASES, ids=[c[0] for c in CASES])
def test_malformed_checkpoint_is_refused_by_the_daemon(daemon, good, tiny_llama, cases_dir, name, breaks, error,
                                                       message):
    d = cases_dir / name
    shutil.copytree(tiny_llama, d)
    breaks(d)
    message = message.replace("{dir}", str(d)).replace("{name}", d.name)
    with pytest.raises(error, match=re.escape(message)):
        daemon.client.load(LoadSpec(path=str(d)), timeout=LOAD_TIMEOUT)
    assert_still_serving(daemon, good)


def test_nul_in_the_path_is_refused(daemon, good, tiny_llama):
    with pytest.raises(InvalidRequestError, match="no NUL"):
        daemon.client.load(LoadSpec(path=f"{tiny_llama}\0x", name="nul"), timeout=LOAD_TIMEOUT)
    assert_still_serving(daemon, good)


def test_path_with_a_name_too_long_is_refused(daemon, good, tmp_path):
    with pytest.raises(CheckpointError, match=re.escape("cannot open (File name too long)")):
        daemon.client.load(LoadSpec(path=str(tmp_path / ("x" * 300)), name="long"), timeout=LOAD_TIMEOUT)
    assert_still_serving(daemon, good)


def assert_still_serving(daemon: DaemonHandle, good: tuple[str, str]) -> None:
    """The good model is listed with its digest, and the daemon logged no traceback."""
    assert [(m.name, m.key.content_digest) for m in daemon.client.list_models()] == [good]
    assert "Traceback" not in daemon.output()


# -- without a daemon: what the daemon cannot be asked for yet (allow_external) --------------------------


def test_hub_cache_layout_needs_allow_external(tiny_llama, tmp_path):
    """A Hugging Face cache snapshot links each file into ../../blobs: refused by default with the
    flag to pass, read with allow_external=True; links that stay inside the directory are fine."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for name in ("config.json", WEIGHTS):
        shutil.copyfile(tiny_llama / name, blobs / name.replace(".", "-"))
        (snapshot / name).symlink_to(f"../../blobs/{name.replace('.', '-')}")
    with pytest.raises(CheckpointError, match=re.escape(FLAG)):
        Checkpoint(snapshot)
    with pytest.raises(CheckpointError, match=EXTERNAL):
        stat_identity(snapshot)
    ckpt = Checkpoint(snapshot, allow_external=True)
    assert ckpt.identity[0].path == str(blobs / "model-safetensors")
    assert stat_identity(snapshot, allow_external=True)[0].inode == ckpt.identity[0].inode
    assert ckpt.read(Q1).shape == (64, 64)
    ckpt.close()

    inside = tmp_path / "inside"
    (inside / "sub").mkdir(parents=True)
    shutil.copyfile(tiny_llama / "config.json", inside / "config.json")
    shutil.copyfile(tiny_llama / WEIGHTS, inside / "sub" / "weights.bin")
    (inside / WEIGHTS).symlink_to("sub/weights.bin")
    assert Checkpoint(inside).identity[0].path == str(inside / "sub" / "weights.bin")


@pytest.mark.parametrize("name", ["config.json", WEIGHTS, "model.safetensors.index.json"])
def test_a_link_swapped_in_after_the_check_does_not_take_the_open_outside(tiny_llama, tmp_path, monkeypatch, name):
    """A file's path is checked (inside), then opened: a link swapped in between, by another process
    writing the directory, must not take the open outside it. Here the swap comes right after the
    check, as a racing process's could; the file opened is checked again, and read with the links
    allowed."""
    import preload_daemon.checkpoint as checkpoint_module
    from safetensors import safe_open
    shutil.copytree(tiny_llama, tmp_path / "m")
    if name.endswith("index.json"):
        with safe_open(str(tmp_path / "m" / WEIGHTS), "pt") as f:
            (tmp_path / "m" / name).write_text(json.dumps({"weight_map": dict.fromkeys(f.keys(), WEIGHTS)}))
    outside = tmp_path / ("real-" + name)
    shutil.copyfile(tmp_path / "m" / name, outside)
    real = checkpoint_module.inside

    def racing(root, path, allow_external):
        checked = real(root, path, allow_external)
        if path.name == name:
            path.unlink()
            path.symlink_to(outside)
        return checked

    monkeypatch.setattr(checkpoint_module, "inside", racing)
    with pytest.raises(CheckpointError, match=f"{name} links to {outside}, outside the checkpoint directory") as e:
        Checkpoint(tmp_path / "m")
    assert FLAG in str(e.value)
    assert Checkpoint(tmp_path / "m", allow_external=True).read(Q1).shape == (64, 64)


def test_special_files_refused_even_when_external_links_are_allowed(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path / "m")
    replace_with(tmp_path / "m", WEIGHTS, lambda p: p.symlink_to("/dev/zero"))
    with pytest.raises(CheckpointError, match=f"{WEIGHTS} is a character device, not a regular file"):
        Checkpoint(tmp_path / "m", allow_external=True)


def test_nul_in_a_path_is_a_checkpoint_error(tiny_llama):
    with pytest.raises(CheckpointError, match="a path cannot contain a NUL byte"):
        Checkpoint(f"{tiny_llama}\0")
    with pytest.raises(CheckpointError, match="a path cannot contain a NUL byte"):
        stat_identity(f"{tiny_llama}\0")


def test_file_replaced_after_its_header_was_read(tiny_llama, tmp_path):
    """The bytes read must come from the file whose header was checked: a file swapped for a FIFO
    (or rewritten) between the two is refused, not read."""
    shutil.copytree(tiny_llama, tmp_path / "m")
    ckpt = Checkpoint(tmp_path / "m")
    replace_with(tmp_path / "m", WEIGHTS, os.mkfifo)
    with pytest.raises(CheckpointError, match="is a FIFO"):
        ckpt.read(Q1)
    replace_with(tmp_path / "m", WEIGHTS, lambda p: shutil.copyfile(tiny_llama / WEIGHTS, p))
    with pytest.raises(CheckpointError, match="changed after its header was read"):
        ckpt.read(Q1)
    ckpt.close()
