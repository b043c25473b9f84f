"""Model builders for tests and benchmarks: small random Hugging Face checkpoints made with
`transformers` on the fly, and large synthetic Llama-shaped checkpoints written with safetensors.

    python -m preload_cli.models tiny llama /tmp/tiny-llama
    python -m preload_cli.models synthetic 4 /tmp/synth-4g
"""

import argparse
import json
import math
import os
import pathlib

import torch
from safetensors.torch import save_file

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def tiny_model(arch: str, path: str | pathlib.Path, dtype: torch.dtype = torch.float32, seed: int = 0,
               mtp_layers: int = 0, mtp_shared: bool = False, **overrides) -> pathlib.Path:
    """A small random `arch` ("llama", "qwen2", "qwen3") checkpoint saved by transformers, with
    `mtp_layers` random DeepSeek-V3-style MTP layers added (`mtp_shared`: each also stores copies of
    the embedding and lm_head, as DeepSeek-V3's checkpoints do)."""
    import transformers

    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = model_cls(config).to(dtype)
    path = pathlib.Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if mtp_layers:
        add_mtp_layers(path, model, mtp_layers, mtp_shared, seed)
    return path


def add_mtp_layers(path: pathlib.Path, model, count: int, shared: bool, seed: int) -> None:
    """Appends `count` MTP layers (model.layers.{L+i}: enorm, hnorm, eh_proj, shared_head.norm and one
    full decoder layer, initialised like the model's own) to a saved single-file checkpoint, and
    num_nextn_predict_layers to its config.json. transformers does not run these; the draft does."""
    from safetensors.torch import load_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    generator = torch.Generator().manual_seed(seed + 1)
    first = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    template = {name.removeprefix("model.layers.0."): t for name, t in tensors.items()
                if name.startswith("model.layers.0.")}
    for i in range(count):
        prefix = f"model.layers.{first + i}."
        for name, like in template.items():  # the full decoder layer: fresh random weights of the same shapes
            fresh = torch.empty(like.shape, dtype=torch.float32).normal_(0, 0.02, generator=generator)
            tensors[prefix + name] = (torch.ones(like.shape) if name.endswith("norm.weight") else fresh).to(dtype)
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[prefix + name] = torch.ones(hidden, dtype=dtype)
        eh = torch.empty(hidden, 2 * hidden, dtype=torch.float32).normal_(0, 0.02, generator=generator)
        tensors[prefix + "eh_proj.weight"] = eh.to(dtype)
        if shared:
            embed = tensors["model.embed_tokens.weight"]
            tensors[prefix + "embed_tokens.weight"] = embed.clone()
            tensors[prefix + "shared_head.head.weight"] = tensors.get("lm_head.weight", embed).clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": count}, indent=2))


def bench_dir() -> pathlib.Path:
    """Where the benchmarks keep the synthetic checkpoints they build once and reuse: $PRELOAD_BENCH_DIR
    (made 0700 if missing), else the cache directory's bench/; either must be ours and only ours to
    write (a checkpoint a stranger planted at a fixed /tmp path was benchmarked as ours)."""
    from preload_daemon.default_model import cache_subdir
    from preload_daemon.errors import PreloadError
    from preload_daemon.runtime_dir import check_ancestors, check_trusted_dir
    if not os.environ.get("PRELOAD_BENCH_DIR"):
        return cache_subdir("bench")
    path, fix = pathlib.Path(os.environ["PRELOAD_BENCH_DIR"]), "set PRELOAD_BENCH_DIR to a directory of your own"
    try:
        check_ancestors(path, fix)  # before anything is made there
        path.mkdir(mode=0o700, exist_ok=True)
        check_trusted_dir(path, "plant a checkpoint we would benchmark", fix)
    except PreloadError as e:
        raise SystemExit(str(e)) from None
    except OSError as e:
        raise SystemExit(f"PRELOAD_BENCH_DIR={path}: cannot make it ({e.strerror}); {fix}") from None
    return path


def synthetic_checkpoint(path: str | pathlib.Path, gigabytes: float, hidden: int | None = None,
                         shard_bytes: int = 1 << 30, num_tensors: int = 0) -> pathlib.Path:
    """A Llama-shaped bf16 checkpoint of about `gigabytes` GB with random weights, split into
    shards of about `shard_bytes` with an index, like a real multi-file checkpoint. With
    `num_tensors`, a model of that many small tensors instead (hidden size 64, as many layers as it
    takes), the shape of the largest models' tensor tables at a fraction of their bytes."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden = hidden or (64 if num_tensors else 512 if gigabytes < 0.5 else 2048)
    inter, heads = hidden * 4, hidden // 64
    # Embeddings and lm_head at most a fifth of the total, as in real models of this size.
    vocab = max(256, min(32768, int(0.1 * gigabytes * 1e9 / (2 * hidden)) // 64 * 64))
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    fixed = 2 * (2 * vocab * hidden + hidden)
    num_layers = max(1, math.ceil((gigabytes * 1e9 - fixed) / layer_bytes))
    if num_tensors:
        vocab, num_layers = 256, max(1, (num_tensors - 3) // 9)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": heads,
              "num_hidden_layers": num_layers, "vocab_size": vocab, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=2))

    def tensors():
        yield "model.embed_tokens.weight", (vocab, hidden)
        for i in range(num_layers):
            p = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield p + f"self_attn.{name}.weight", (hidden, hidden)
            yield p + "mlp.gate_proj.weight", (inter, hidden)
            yield p + "mlp.up_proj.weight", (inter, hidden)
            yield p + "mlp.down_proj.weight", (hidden, inter)
            yield p + "input_layernorm.weight", (hidden,)
            yield p + "post_attention_layernorm.weight", (hidden,)
        yield "model.norm.weight", (hidden,)
        yield "lm_head.weight", (vocab, hidden)

    generator = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shape in tensors():
        current[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
        size += current[name].nbytes
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("tiny")
    p.add_argument("arch", choices=["llama", "qwen2", "qwen3"])
    p.add_argument("path")
    p = sub.add_parser("synthetic")
    p.add_argument("gigabytes", type=float)
    p.add_argument("path")
    args = parser.parse_args()
    if args.kind == "tiny":
        print(tiny_model(args.arch, args.path))
    else:
        print(synthetic_checkpoint(args.path, args.gigabytes))


if __name__ == "__main__":
    main()
