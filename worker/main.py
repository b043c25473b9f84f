"""Entry points of the engine worker: `run_engine` (HTTP server), `run_generate` (one shot) and
`run_follower` (a TP rank other than 0). All build the same way: join the TP group, load this
rank's weights, tell the group how it went, build the model on them, start the engine."""

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import uvicorn

from preload_daemon.arch import ArchSpec
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import InvalidRequestError, PreloadError
from worker.config import EngineConfig
from worker.engine import Engine, SamplingParams
from worker.loader import LoadedWeights, LoadRequest, load_weights
from worker.model import CausalLM
from worker.parallel import Leader, ParallelError, Rendezvous, TPGroup, follow
from worker.server import build_app
from worker.state import WorkerState, process_start_time
from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)
# Starts TP ranks 1..N-1 of this engine given rank 0's store port: [(rank, process)].
PR_SET_PDEATHSIG = 1
SpawnFollowers = Callable[[int], list[tuple[int, subprocess.Popen]]]


class RankFailedError(PreloadError):
    """A TP rank could not load its weights, or died."""


@dataclasses.dataclass(slots=True)
class Built:
    weights: LoadedWeights
    model: CausalLM | Leader
    group: TPGroup | None
    ranks: list[dict]
    """Every rank's readiness document (rank, device, load format, timings), by rank."""


def check_fits(config: EngineConfig) -> None:
    """Refuses a TP size the model cannot be split into before any process starts or byte is read."""
    checkpoint = Checkpoint(config.model)
    try:
        ArchSpec.from_config(checkpoint.config, f"{config.model}/config.json").check_tp(config.tp_size,
                                                                                          config.quantization)
    finally:
        checkpoint.close()


def open_group(config: EngineConfig, spawn: SpawnFollowers | None = None,
               followers: list | None = None) -> TPGroup | None:
    """This rank's TP group (None at TP 1). Rank 0 hosts the rendezvous and, given `spawn`, starts
    the other ranks, recording them in `followers`. Call it from a thread that outlives the
    followers: they are told to die with the thread that started them."""
    if config.tp_size == 1:
        return None
    group = TPGroup(Rendezvous(rank=config.tp_rank, size=config.tp_size, addr=config.rendezvous_addr,
                               port=config.rendezvous_port, env=config.rendezvous_env), config.device)
    if spawn is not None:
        followers.extend(spawn(group.port))
    return group


def build(config: EngineConfig, process_start: float, group: TPGroup | None) -> Built:
    """Joins the TP group, loads this rank's weights and gathers every rank's outcome."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if group is not None:
        group.join()
    doc = {"rank": config.tp_rank, "device": config.device, "pid": os.getpid(), "process_start": process_start}
    weights, error = None, ""
    try:
        request = LoadRequest(spec=config.load_spec(), device=config.device, runtime_dir=config.runtime_dir,
                              fallback=config.fallback)
        weights = load_weights(config.load_format, request)
        doc.update(load_format=weights.load_format, fallback_reason=weights.fallback_reason,
                   weights_start=weights.started, weights_done=weights.finished,
                   weights_version=weights.attached.version if weights.attached else 0)
    except (PreloadError, OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    doc["error"] = error
    ranks = group.exchange(doc) if group is not None else [doc]
    failed = [r for r in ranks if r["error"]]
    if failed:
        if group is not None:
            group.close()
        raise RankFailedError("; ".join(f"TP rank {r['rank']} on {r['device']}: {r['error']}" for r in failed))
    model = CausalLM(ArchSpec.from_config(weights.config, f"{config.model}/config.json"), weights.tensors, group)
    return Built(weights, Leader(model, group) if group is not None and group.rank == 0 else model, group, ranks)


def start_engine(config: EngineConfig, built: Built) -> Engine:
    engine = Engine(built.model, max_batch=config.max_batch, max_len=config.max_model_len).start()
    engine.generate([0], SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up: first request pays nothing extra
    return engine


def run_follower(config: EngineConfig) -> int:
    """TP rank > 0: load, report, then run the forwards rank 0 announces until it says stop."""
    try:
        built = build(config, process_start_time(), open_group(config))
    except RankFailedError as e:
        log.error("rank %d: %s", config.tp_rank, e)
        return 1
    try:
        follow(built.model, built.group, config.max_batch, min(config.max_model_len,
                                                               built.model.spec.max_position_embeddings))
    except ParallelError as e:
        log.error("%s", e)
        return 1
    finally:
        built.group.close()
    return 0


def die_with_parent() -> None:
    """preexec_fn of child processes: the kernel kills the child when the thread that started it
    ends (with its process), so no rank or replica outlives its engine, even after kill -9."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn_child(argv: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, **popen)


def watch_followers(followers: list[tuple[int, subprocess.Popen]], stopping: threading.Event) -> None:
    """If a TP rank dies, the engine cannot go on: say which one, end the others, exit non-zero."""
    def watch() -> None:
        while not stopping.wait(0.2):
            for rank, proc in followers:
                if proc.poll() is not None and not stopping.is_set():
                    reason = f"TP rank {rank} (pid {proc.pid}) exited with code {proc.returncode}; stopping the engine"
                    log.error("%s", reason)
                    print(json.dumps({"event": "failed", "error": reason}), flush=True)
                    stop_followers(followers)
                    os._exit(1)

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()


def stop_followers(followers: list[tuple[int, subprocess.Popen]], timeout: float = 5.0) -> None:
    for _, proc in followers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for _, proc in followers:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_engine(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, uds: str = "",
               spawn: SpawnFollowers | None = None) -> int:
    """Rank 0: the HTTP server. Ready once every rank has loaded and the engine has warmed up."""
    check_fits(config)
    state = WorkerState(config.name, config.load_format, config.replica)
    listen = {"uds": uds} if uds else {"host": host, "port": port}
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", lifespan="off", **listen))
    outcome = {"code": 0}
    followers: list[tuple[int, subprocess.Popen]] = []
    stopping = threading.Event()
    leaders: list[Leader] = []

    def fail(reason: str) -> None:
        state.failure = reason
        outcome["code"] = 1
        server.should_exit = True

    group = open_group(config, spawn, followers)

    def start() -> None:
        try:
            built = build(config, state.process_start, group)
            if isinstance(built.model, Leader):
                built.model.on_broken = fail
                leaders.append(built.model)
            engine = start_engine(config, built)
            while not server.started:
                if server.should_exit:
                    return
                time.sleep(0.005)
            where = uds or server.servers[0].sockets[0].getsockname()[1]
            body = state.set_ready(built.weights, engine, Tokenizer.load(config.model), built.ranks)
            print(json.dumps({"event": "ready", "port": where if not uds else 0, "uds": uds, **body}), flush=True)
            log.info("engine for %s ready on %s (%s%s)", state.name, where, built.weights.load_format,
                     f", fell back: {built.weights.fallback_reason}" if built.weights.fallback_reason else "")
            state.watch_lease()
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            log.error("engine for %s failed to start: %s", state.name, reason)
            print(json.dumps({"event": "failed", "model": state.name, "error": reason}), flush=True)
            fail(reason)

    if spawn is not None and config.tp_size > 1:
        watch_followers(followers, stopping)
    threading.Thread(target=start, name="engine-start", daemon=True).start()
    try:
        server.run()
    finally:
        stopping.set()
        if state.engine is not None:
            state.engine.stop()
        for leader in leaders:
            leader.close()
        stop_followers(followers)
    return outcome["code"]


def run_generate(config: EngineConfig, prompt: str | list[int], params: SamplingParams, chat: bool = False,
                 spawn: SpawnFollowers | None = None) -> int:
    """One request, JSON on stdout. `prompt` is text, or token ids for checkpoints without a tokenizer."""
    process_start = process_start_time()
    check_fits(config)
    tokenizer = Tokenizer.load(config.model)
    if tokenizer is None and isinstance(prompt, str):
        raise InvalidRequestError(f"{config.model} has no tokenizer.json; pass the prompt as --prompt-ids")
    if isinstance(prompt, str):
        ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt)
    else:
        ids = prompt
    followers: list[tuple[int, subprocess.Popen]] = []
    stopping = threading.Event()
    if spawn is not None and config.tp_size > 1:
        watch_followers(followers, stopping)
    try:
        built = build(config, process_start, open_group(config, spawn, followers))
        engine = start_engine(config, built)
        ready = time.time()
        result = engine.generate(ids, params)
        engine.stop()
        if isinstance(built.model, Leader):
            built.model.close()
    finally:
        stopping.set()
        stop_followers(followers)
    weights = built.weights
    print(json.dumps({
        "model": config.name, "prompt": prompt, "text": tokenizer.decode(result.tokens) if tokenizer else "",
        "token_ids": result.tokens, "prompt_tokens": len(ids), "finish_reason": result.finish_reason,
        "load_format": weights.load_format, "fallback_reason": weights.fallback_reason, "tp_size": config.tp_size,
        "ranks": built.ranks,
        "timings": {"process_start": process_start, "weights_start": weights.started,
                    "weights_done": weights.finished, "ready": ready, "generate_seconds": result.seconds,
                    "tokens_per_second": len(result.tokens) / max(result.seconds, 1e-9)}}, indent=2))
    return 0
