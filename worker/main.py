"""Entry points of the engine worker: `preload engine` (HTTP server) and `preload generate`
(one-shot). Both build the same way: load weights, build the model on them, start the engine."""

import json
import logging
import os
import pathlib
import sys
import threading
import time

import uvicorn

from preload_daemon.default_model import default_model_path
from preload_daemon.plan import LoadSpec
from worker.engine import Engine, SamplingParams
from worker.loader import LoadedWeights, LoadRequest, load_weights
from worker.model import CausalLM, ModelConfig
from worker.server import build_app
from worker.state import WorkerState, process_start_time
from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def model_path(args) -> pathlib.Path:
    return pathlib.Path(os.path.abspath(args.model)) if args.model else default_model_path()


def build(args, path: pathlib.Path) -> tuple[LoadedWeights, Engine, Tokenizer | None]:
    spec = LoadSpec(path=str(path), name=args.name, dtype=args.dtype, quantization=args.quantization)
    request = LoadRequest(spec=spec, device=args.device, runtime_dir=args.runtime_dir, fallback=not args.no_fallback)
    weights = load_weights(args.load_format, request)
    model = CausalLM(ModelConfig.from_hf(weights.config), weights.tensors)
    engine = Engine(model, max_batch=args.max_batch, max_len=args.max_model_len).start()
    engine.generate([0], SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up: first request pays nothing extra
    return weights, engine, Tokenizer.load(path)


def cmd_engine(args) -> int:
    path = model_path(args)
    state = WorkerState(args.name or path.name, args.load_format)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning",
                                           lifespan="off"))
    outcome = {"code": 0}

    def start() -> None:
        try:
            weights, engine, tokenizer = build(args, path)
            while not server.started:
                if server.should_exit:
                    return
                time.sleep(0.005)
            port = server.servers[0].sockets[0].getsockname()[1]
            body = state.set_ready(weights, engine, tokenizer)
            print(json.dumps({"event": "ready", "port": port, **body}), flush=True)
            log.info("engine for %s ready on port %d (%s%s)", state.name, port, weights.load_format,
                     f", fell back: {weights.fallback_reason}" if weights.fallback_reason else "")
            state.watch_lease()
        except Exception as e:
            state.failure = f"{type(e).__name__}: {e}"
            log.error("engine for %s failed to start: %s", state.name, state.failure)
            print(json.dumps({"event": "failed", "model": state.name, "error": state.failure}), flush=True)
            outcome["code"] = 1
            server.should_exit = True

    threading.Thread(target=start, name="engine-start", daemon=True).start()
    server.run()
    if state.engine is not None:
        state.engine.stop()
    return outcome["code"]


def cmd_generate(args) -> int:
    path = model_path(args)
    process_start = process_start_time()
    weights, engine, tokenizer = build(args, path)
    ready = time.time()
    if tokenizer is None:
        print(f"preload generate: {path} has no tokenizer.json; cannot encode a text prompt", file=sys.stderr)
        return 1
    prompt = tokenizer.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    ids = tokenizer.encode(prompt)
    result = engine.generate(ids, params)
    engine.stop()
    print(json.dumps({
        "model": args.name or path.name, "prompt": args.prompt, "text": tokenizer.decode(result.tokens),
        "token_ids": result.tokens, "prompt_tokens": len(ids), "finish_reason": result.finish_reason,
        "load_format": weights.load_format, "fallback_reason": weights.fallback_reason,
        "timings": {"process_start": process_start, "weights_start": weights.started,
                    "weights_done": weights.finished, "ready": ready, "generate_seconds": result.seconds,
                    "tokens_per_second": len(result.tokens) / max(result.seconds, 1e-9)}}, indent=2))
    return 0
