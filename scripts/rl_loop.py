"""An RL loop on preload: a trainer publishes its live weights as versions, rollout engines attach to
the newest one zero-copy, and a bad step is undone by rolling back.

What it does, all on real processes and sockets (cpu:0):

1. Starts a daemon in the runtime directory (or reuses the one there) and loads MODEL as the first
   version of NAME, as `preload serve MODEL --name NAME --no-supervise` would.
2. Loads MODEL in this process with transformers: the trainer.
3. For each step k = 1..STEPS:
   - a fake training step: small seeded noise added in place to some layers' weights;
   - publishes the trainer's live tensors as the next version of NAME, straight from memory
     (`preload_daemon.versions.publish_tensors`: nothing is written to disk);
   - starts a rollout engine on it (`preload generate MODEL --name NAME --weights-version active`:
     MODEL gives the config and tokenizer, the weights come from the daemon) and records its
     greedy tokens;
   - computes the same greedy continuation with transformers on the trainer's current weights and
     checks that the two agree.
   Step 1's version is pinned, so that retention (which keeps 2 older versions) never frees it.
4. Rolls back to step 1's version (`preload rollback NAME --to V`), starts a rollout engine again
   and checks that it reproduces step 1's tokens.

One line per step, a summary, and exit code 0 only if every check held (1 on a mismatch or an
error). A daemon this script started is stopped at the end; a reused one is left running, with
step 1's version unpinned again.

    .venv/bin/python scripts/rl_loop.py                           # the default model, 3 steps
    .venv/bin/python scripts/rl_loop.py --model /models/llama --steps 5 --runtime-dir /tmp/rl
"""

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout: `python scripts/rl_loop.py`

from preload_daemon.arch import ArchSpec  # noqa: E402
from preload_daemon.config import default_runtime_dir  # noqa: E402
from preload_daemon.default_model import default_model_path  # noqa: E402
from preload_daemon.errors import PreloadError  # noqa: E402
from preload_daemon.plan import Layout  # noqa: E402
from preload_daemon.supervisor import ensure_daemon  # noqa: E402
from preload_daemon.versions import Target, publish_dir, publish_tensors, rollback, set_pinned  # noqa: E402

DEVICE = "cpu:0"
PROMPT = "The capital of France is"
FALLBACK_PROMPT_IDS = [1, 17, 42, 99, 7, 13]  # for checkpoints without a tokenizer
PERTURBED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--name", default="", help="model name in the daemon (default: MODEL's directory name "
                                                   "+ '-rl', so that a served MODEL's pointer is left alone)")
    parser.add_argument("--steps", type=int, default=3, help="training steps, one published version each")
    parser.add_argument("--runtime-dir", type=pathlib.Path, default=None,
                        help="daemon sockets and logs (default: $PRELOAD_RUNTIME_DIR, $XDG_RUNTIME_DIR/preload "
                             "or /tmp/preload-$UID)")
    parser.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per rollout (default 8)")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="a step's noise, relative to each perturbed weight's standard deviation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


def prompt_ids(model_dir: pathlib.Path) -> list[int]:
    """PROMPT's token ids with the checkpoint's tokenizer, else fixed ids."""
    if not (model_dir / "tokenizer.json").exists():
        return FALLBACK_PROMPT_IDS
    from worker.tokenizer import Tokenizer
    return Tokenizer(model_dir).encode(PROMPT)


def training_step(model, step: int, seed: int, noise: float) -> int:
    """A stand-in for an optimizer step: seeded noise added in place to every layer's attention
    output and MLP down projections. Returns the number of tensors changed."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    changed = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(PERTURBED):
                scale = noise * param.float().std()
                param.add_((torch.randn(param.shape, generator=generator) * scale).to(param.dtype))
                changed += 1
    return changed


@torch.no_grad()
def reference_tokens(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """transformers' greedy continuation, cut before the first eos token (the engine ends there: an
    eos is not text)."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else min(eos, default=0)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    tokens = out[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[:ends[0]] if ends else tokens


def rollout(model_dir: pathlib.Path, name: str, runtime_dir: pathlib.Path, prompt: list[int],
            max_tokens: int) -> dict:
    """A fresh `preload generate` process on NAME's active version: its JSON (token_ids, weights_version...)."""
    cmd = [sys.executable, "-m", "preload_cli", "generate", str(model_dir), "--name", name,
           "--weights-version", "active", "--load-format", "ipc_cache", "--no-fallback",
           "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(max_tokens), "--temperature", "0",
           "--runtime-dir", str(runtime_dir), "--log-level", "WARNING"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"rollout engine failed (exit {out.returncode}):\n{out.stderr.strip()}")
    return json.loads(out.stdout)


def text(engine: dict) -> str:
    return f" {engine['text']!r}" if engine.get("text") else ""


def check(engine: dict, expected_version: int) -> None:
    if engine["weights_version"] != expected_version or engine["load_format"] != "ipc_cache":
        raise RuntimeError(f"the rollout engine ran on {engine['load_format']} v{engine['weights_version']}, "
                           f"not the daemon's v{expected_version}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers  # after argument parsing: --help stays quick
    transformers.utils.logging.disable_progress_bar()

    model_dir = pathlib.Path(args.model).resolve() if args.model else default_model_path()
    name = args.name or f"{model_dir.name}-rl"
    runtime_dir = args.runtime_dir.resolve() if args.runtime_dir else default_runtime_dir()
    prompt = prompt_ids(model_dir)
    daemon = ensure_daemon(DEVICE, runtime_dir, "WARNING")
    print(f"daemon on {DEVICE} in {runtime_dir}: " + (f"started (pid {daemon.proc.pid})" if daemon else "reused"))
    pinned = None
    failures: list[str] = []
    try:
        base = publish_dir(name, str(model_dir), [Target(DEVICE, [Layout()])], runtime_dir, show_progress=False)
        print(f"base: {name} v{base.version} from {model_dir} ({base.variants[0][0].slab_bytes / 2**20:.1f} MiB)")

        trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
        config = trainer.config.to_dict()
        eos = set(ArchSpec.from_config(config).eos_token_ids)
        print(f"trainer: transformers {type(trainer).__name__} ({next(trainer.parameters()).dtype}); "
              f"prompt ids {prompt}, {args.max_tokens} greedy tokens")

        history = []  # (version, tokens) per step
        for step in range(1, args.steps + 1):
            changed = training_step(trainer, step, args.seed, args.noise)
            started = time.monotonic()
            version = publish_tensors(name, trainer.state_dict(), config, runtime_dir=runtime_dir,
                                      label=f"rl step {step}")
            publish_s = time.monotonic() - started
            if step == 1:
                set_pinned(name, version, True, runtime_dir)
                pinned = version
            engine = rollout(model_dir, name, runtime_dir, prompt, args.max_tokens)
            check(engine, version)
            expected = reference_tokens(trainer, prompt, args.max_tokens, eos)
            ok = engine["token_ids"] == expected
            if not ok:
                failures.append(f"step {step} (v{version}): engine {engine['token_ids']} != transformers {expected}")
            history.append((version, engine["token_ids"]))
            print(f"step {step}: v{version} ({changed} tensors changed, published in {publish_s:.2f}s)  "
                  f"engine {engine['token_ids']}{text(engine)}  transformers {expected}  "
                  f"{'match' if ok else 'MISMATCH'}", flush=True)

        version, tokens = history[0]
        rollback(name, version, runtime_dir)
        engine = rollout(model_dir, name, runtime_dir, prompt, args.max_tokens)
        check(engine, version)
        ok = engine["token_ids"] == tokens
        if not ok:
            failures.append(f"rollback to v{version}: engine {engine['token_ids']} != step 1's {tokens}")
        others = [f"v{v}" for v, t in history[1:] if t != tokens]
        note = f" ({', '.join(others)} gave other tokens)" if others else \
            "" if len(history) == 1 else " (every step gave these tokens; a larger --noise makes steps differ)"
        print(f"rollback: v{version} active again  engine {engine['token_ids']}{text(engine)}  step 1 {tokens}  "
              f"{'match' if ok else 'MISMATCH'}{note}", flush=True)
    finally:
        if pinned is not None and daemon is None:  # a reused daemon keeps running: leave retention as it was
            try:
                set_pinned(name, pinned, False, runtime_dir)
            except PreloadError as e:
                print(f"rl_loop: could not unpin {name} v{pinned}: {e}", file=sys.stderr)
        if daemon is not None:
            daemon.stop()
    if failures:
        print(f"summary: FAILED, {len(failures)} mismatch(es):\n  " + "\n  ".join(failures))
        return 1
    print(f"summary: ok, {args.steps} step(s) published and served, each matching transformers; "
          f"the rollback to v{history[0][0]} reproduced step 1's tokens")
    return 0


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through main's `finally`: the pin undone, a daemon we started stopped


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminated)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except (PreloadError, RuntimeError, OSError) as e:
        print(f"rl_loop: {e}", file=sys.stderr)
        sys.exit(1)
