"""Entry points of the engine worker: `run_engine` (HTTP server), `run_generate` (one shot) and
`run_follower` (a TP rank other than 0). All build the same way: join the TP group, load this
rank's weights, tell the group how it went, build the model on them, start the engine."""

import dataclasses
import errno
import gc
import hashlib
import json
import logging
import os
import pathlib
import socket
import threading
import time

import torch
import uvicorn

from preload_daemon.arch import ArchSpec
from preload_daemon.errors import InvalidRequestError, PreloadError
from preload_daemon.hfconfig import read_config
from preload_daemon.plan import LoadSpec
from preload_daemon.safepath import read_regular
from worker import template_process
from worker.config import EngineConfig
from worker.engine import Engine
from worker.http_limits import BoundedH11
from worker.requests import SamplingParams
from worker.loader import LeaseKeeper, LoadedWeights, LoadRequest, load_weights
from worker.model import CausalLM
from worker.mtp import MTPDraft
from worker.parallel import Leader, ParallelError, Rendezvous, TPGroup, follow
from worker.ranks import Followers, stop_followers, watch_followers
from worker.quiesce import Quiescer
from worker.speculative import Speculator
from worker.server import build_app
from worker.state import WorkerState, process_start_time
from worker.tokenizer import FIX, TOKENIZER_MAX_BYTES, Tokenizer, generation_eos

log = logging.getLogger(__name__)


class RankFailedError(PreloadError):
    """A TP rank could not load its weights, or died."""


@dataclasses.dataclass(slots=True)
class Built:
    weights: LoadedWeights
    model: CausalLM | Leader
    group: TPGroup | None
    ranks: list[dict]
    """Every rank's readiness document (rank, device, load format, timings), by rank."""
    speculator: Speculator | None = None
    draft: LoadedWeights | None = None
    """The draft's weights (their lease lives as long as the engine)."""


def open_group(config: EngineConfig) -> TPGroup | None:
    """This rank's TP group (None at TP 1); rank 0 hosts the rendezvous on config.rendezvous_port."""
    if config.tp_size == 1:
        return None
    return TPGroup(Rendezvous(rank=config.tp_rank, size=config.tp_size, addr=config.rendezvous_addr,
                              port=config.rendezvous_port, env=config.rendezvous_env), config.device)


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
                              fallback=config.fallback, weights_version=config.weights_version,
                              wait_for_daemon=config.wait_for_daemon, allow_external=config.allow_external_links)
        weights = load_weights(config.load_format, request)
        doc.update(load_format=weights.load_format, fallback_reason=weights.fallback_reason,
                   weights_start=weights.started, weights_done=weights.finished, weights_version=weights.version)
        if config.speculative:
            draft = load_draft(config, request)
            doc["draft"] = {"kind": config.speculative, "load_format": draft.load_format,
                            "fallback_reason": draft.fallback_reason, "weights_version": draft.version}
            weights.finished = draft.finished
    except (PreloadError, OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    doc["error"] = error[:4000]
    ranks = group.exchange(doc) if group is not None else [doc]
    failed = [r for r in ranks if r["error"]]
    versions = {r["weights_version"] for r in ranks if not r["error"]}
    if not failed and len(versions) > 1:  # a publish moved the pointers while the ranks attached
        failed = [{**r, "error": f"attached {config.name} v{r['weights_version']}, while other ranks attached "
                                 f"v{', v'.join(map(str, sorted(versions - {r['weights_version']})))}; start the "
                                 "engine again (or pin it with --weights-version V)"} for r in ranks[:1]]
    if failed:  # the group stays open: rank 0 reports, then ends the others (see run_follower)
        raise RankFailedError("; ".join(f"TP rank {r['rank']} on {r['device']}: {r['error']}" for r in failed))
    spec = ArchSpec.from_config(weights.config, f"{config.model}/config.json")
    model = CausalLM(spec, weights.tensors, group)
    speculator = None
    if config.speculative == "mtp":
        shared = {n: weights.tensors[n] for n in (spec.name("embed"), spec.name("lm_head")) if n in weights.tensors}
        speculator = Speculator(MTPDraft(spec, {**shared, **draft.tensors}, group), config.num_speculative_tokens)
    elif config.speculative == "draft":
        draft_spec = ArchSpec.from_config(draft.config, f"{config.draft_model}/config.json")
        speculator = Speculator(CausalLM(draft_spec, draft.tensors, group), config.num_speculative_tokens)
    leader = Leader(model, group) if group is not None and group.rank == 0 else model
    if speculator is not None and isinstance(leader, Leader):  # the followers run the draft's forwards too
        speculator = Speculator(leader.draft(speculator.model), speculator.k, speculator.kind)
    return Built(weights, leader, group, ranks, speculator, draft if config.speculative else None)


def load_draft(config: EngineConfig, main: LoadRequest) -> LoadedWeights:
    """The draft's weights: the checkpoint's MTP layers (the draft component of the same version),
    or a separate draft checkpoint with the same vocabulary and tokenizer. Warm from the daemon with
    the same fallback rules as the main model, each with its own lease."""
    if config.speculative == "mtp":
        spec = dataclasses.replace(main.spec, component="draft")
        return load_weights(config.load_format, dataclasses.replace(main, spec=spec))
    check_draft_vocabulary(config.model, config.draft_model)
    # In the main model's layout, quantization included, as `preload serve --draft-model` loads it
    # (asked for unquantized, a quantized engine's draft never found its variant and always ran cold).
    spec = LoadSpec(path=str(config.draft_model), dtype=config.dtype, quantization=main.spec.quantization,
                    tp_size=config.tp_size, tp_rank=config.tp_rank)
    return load_weights(config.load_format, dataclasses.replace(main, spec=spec, weights_version=""))


def check_draft_vocabulary(model: pathlib.Path, draft: pathlib.Path) -> None:
    """A draft's token ids must mean what the main model's mean: same vocabulary size, and the same
    tokenizer.json when both have one."""
    sizes = [ArchSpec.from_config(read_config(d), f"{d}/config.json").vocab_size for d in (model, draft)]
    if sizes[0] != sizes[1]:
        raise InvalidRequestError(f"the draft model {draft} has a vocabulary of {sizes[1]} tokens, the main model "
                                  f"{sizes[0]}; a draft must share the main model's tokenizer and vocabulary")
    tokenizers = [d / "tokenizer.json" for d in (model, draft)]
    if all(t.is_file() for t in tokenizers):
        digests = [hashlib.sha256(read_regular(t, TOKENIZER_MAX_BYTES, FIX)).hexdigest() for t in tokenizers]
        if digests[0] != digests[1]:
            raise InvalidRequestError(f"the draft model {draft} has another tokenizer.json than {model}; a draft "
                                      "must share the main model's tokenizer")


class WarmUpError(PreloadError):
    """The engine's first request, run before it is ready, failed: it would fail every request."""


def start_engine(config: EngineConfig, built: Built) -> Engine:
    if 0 < config.prefill_chunk < 64:
        log.warning("--prefill-chunk %d: each part of a long prompt reads every weight once, so parts this small "
                    "make its prefill several times slower (1: 10x); the default is 256", config.prefill_chunk)
    if config.max_model_len > (positions := built.model.spec.max_position_embeddings):
        log.warning("--max-model-len %d is past the model's max_position_embeddings (%d): a request gets at most "
                    "%d positions", config.max_model_len, positions, positions)
    engine = Engine(built.model, max_batch=config.max_batch, max_len=config.max_model_len,
                    speculator=built.speculator, prefill_chunk=config.prefill_chunk,
                    eos_token_ids=generation_eos(config.model, config.allow_external_links)).start()
    try:
        engine.generate([0], SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up: the first request pays nothing
    except BaseException as e:  # Ctrl-C meanwhile: the scheduler ends its step before the interpreter exits
        engine.stop()
        if isinstance(e, RuntimeError):  # the request's error (NaN logits: the weights hold them)
            raise WarmUpError(f"the engine's warm-up request failed, so it cannot serve: "
                              f"{str(e).removeprefix('error: ')}") from e
        raise
    return engine


def started() -> None:
    """Start-up is over (ready, or failed). `preload engine` holds the cyclic garbage collector off
    from its first heavy import (torch's alone makes millions of objects that live as long as the
    process, and each collection pass walks them all: ~0.2 s of every start). What start-up made is
    moved out of the collector's sight for good, and collection resumes."""
    gc.freeze()
    gc.enable()


def run_follower(config: EngineConfig) -> int:
    """TP rank > 0: load, report, then run the forwards rank 0 announces until it says stop."""
    group = open_group(config)
    try:
        built = build(config, process_start_time(), group)
    except RankFailedError as e:
        started()
        # Rank 0 saw the same and reports it; exiting first would race its report with the news of
        # a dead rank, so wait until it ends this process (or the group).
        log.error("rank %d: %s", config.tp_rank, e)
        try:
            group.receive_step()
        except RuntimeError:
            pass
        return 1
    for weights in (built.weights, built.draft):  # this rank's leases survive a restart of its daemon
        if weights is not None and weights.attached is not None:
            LeaseKeeper(weights, config.device, config.runtime_dir).start()
    started()
    try:
        ahead = config.num_speculative_tokens if config.speculative else 0  # as Engine sizes rank 0's caches
        follow(built.model, built.group, config.max_batch,
               built.model.spec.context_len(config.max_model_len) + ahead,
               built.speculator.model if built.speculator else None)
    except ParallelError as e:
        log.error("%s", e)
        return 1
    finally:
        built.group.close()
    return 0


def run_engine(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, uds: str = "",
               followers: Followers = ()) -> int:
    """Rank 0: the HTTP server. Ready once every rank has loaded and the engine has warmed up.
    `followers`: the processes of ranks 1..N-1 when this engine started them."""
    config.check_fits()
    sockets = None if uds else [listen_tcp(host, port)]  # a busy port or an unknown host: said before loading
    state = WorkerState(config.name, config.load_format, config.replica)
    listen = {"uds": uds} if uds else {"host": host, "port": port}
    app = build_app(state)
    server = new_server(app, listen)  # after each snapshot's resume, a new one
    # A TP 1 engine on a TCP port can be snapshotted (worker/quiesce.py): it serves again, on the
    # socket the snapshot's resume gives, after each quiet point.
    quiet = Quiescer(state, config, listen) if config.tp_size == 1 and not uds else None
    state.snapshot_agent = quiet
    outcome = {"code": 0}
    stopping = threading.Event()
    leaders: list[Leader] = []

    def fail(reason: str) -> None:
        state.failure = reason
        outcome["code"] = 1
        server.should_exit = True

    def start() -> None:
        try:
            built = build(config, state.process_start, open_group(config))
            if isinstance(built.model, Leader):
                built.model.on_broken = fail
                leaders.append(built.model)
            engine = start_engine(config, built)
            while not server.started:
                if server.should_exit:
                    return
                time.sleep(0.005)
            where = uds or server.servers[0].sockets[0].getsockname()[1]
            if quiet is not None:  # a snapshot's resume listens where this engine does (--port 0 included)
                quiet.listen["port"] = where
            tokenizer = Tokenizer.load(config.model, config.allow_external_links)
            # Before ready, which a snapshot waits for: its quiet point stops what these start.
            state.weights, state.draft = built.weights, built.draft
            state.keep_leases(config.device, config.runtime_dir)
            if tokenizer is not None and tokenizer.has_chat_template:
                template_process.RENDERER.warm()  # now, not on the first chat request
            body = state.set_ready(built.weights, engine, tokenizer, built.ranks)
            print(json.dumps({"event": "ready", "port": where if not uds else 0, "uds": uds, **body}), flush=True)
            log.info("engine for %s ready on %s (%s%s)", state.name, where, built.weights.load_format,
                     f", fell back: {built.weights.fallback_reason}" if built.weights.fallback_reason else "")
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            log.error("engine for %s failed to start: %s", state.name, reason)
            print(json.dumps({"event": "failed", "model": state.name, "error": reason}), flush=True)
            fail(reason)
        finally:
            started()

    watch_followers(followers, stopping, leaders, config.tp_step_timeout if config.tp_size > 1 else 0.0)
    threading.Thread(target=start, name="engine-start", daemon=True).start()
    try:
        while True:
            if quiet is not None:
                quiet.server = server
            server.run(sockets=sockets)
            sockets = quiet.server_returned() if quiet is not None and not state.failure else None
            if sockets is None:
                break
            server = new_server(app, listen)
    finally:
        stopping.set()
        if state.engine is not None:
            state.engine.stop()
        for leader in leaders:
            leader.close()
            leader.group.close()
        stop_followers(followers)
    return outcome["code"]


def listen_tcp(host: str, port: int) -> socket.socket:
    """The engine's listening socket, bound here so that a port in use or a host that is not this
    one's is one line naming the flag (uvicorn logged its own text and exited with code 3). Bound as
    uvicorn binds it: IPv6 for a host with a colon, IPv4 otherwise ("localhost": 127.0.0.1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        return socket.create_server((host, port), family=family, backlog=2048)
    except socket.gaierror as e:
        raise InvalidRequestError(f"--host {host}: {e.strerror}; give an address of this host, such as 127.0.0.1 "
                                  "or 0.0.0.0") from None
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        if e.errno == errno.EADDRNOTAVAIL:
            raise InvalidRequestError(f"--host {host}: cannot listen there ({why}): it is not an address of this "
                                      "host; give one that is, such as 127.0.0.1 or 0.0.0.0") from None
        raise InvalidRequestError(f"--port {port}: cannot listen on {host}:{port} ({why}); pick a free port, or 0 "
                                  "for any") from None


def new_server(app, listen: dict) -> uvicorn.Server:
    """The engine's HTTP server: open requests get 30 s to finish when it shuts down (a snapshot's
    quiet point sets its own drain time); connections are bounded (worker/http_limits.py)."""
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=30,
                                         http=BoundedH11, **listen))


def run_generate(config: EngineConfig, prompt: str | list[int], params: SamplingParams, chat: bool = False,
                 followers: Followers = ()) -> int:
    """One request, JSON on stdout. `prompt` is text, or token ids for checkpoints without a tokenizer."""
    process_start = process_start_time()
    config.check_fits()
    tokenizer = Tokenizer.load(config.model, config.allow_external_links)
    if tokenizer is None and isinstance(prompt, str):
        raise InvalidRequestError(f"{config.model} has no tokenizer.json; pass the prompt as --prompt-ids")
    if isinstance(prompt, str):
        ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt)
    else:
        ids = prompt
    stopping, leaders = threading.Event(), []
    watch_followers(followers, stopping, leaders, config.tp_step_timeout if config.tp_size > 1 else 0.0)
    engine = None
    try:
        built = build(config, process_start, open_group(config))
        if isinstance(built.model, Leader):
            leaders.append(built.model)
        engine = start_engine(config, built)
        ready = time.time()
        result = engine.generate(ids, params)
        engine.stop()
        if isinstance(built.model, Leader):
            built.model.close()
            built.group.close()  # a process group left alive at exit can abort the interpreter
    except KeyboardInterrupt:  # the scheduler ends its step first: a thread still in native code at exit aborts
        if engine is not None:
            engine.stop()
        raise
    finally:
        stopping.set()
        stop_followers(followers)
    weights = built.weights
    print(json.dumps({
        "model": config.name, "prompt": prompt, "text": tokenizer.decode(result.tokens) if tokenizer else "",
        "token_ids": result.tokens, "prompt_tokens": len(ids), "finish_reason": result.finish_reason,
        "load_format": weights.load_format, "fallback_reason": weights.fallback_reason,
        "weights_version": weights.version, "tp_size": config.tp_size,
        **({"draft": built.ranks[0].get("draft"), "speculation": engine.speculation()} if config.speculative else {}),
        "ranks": built.ranks,
        "timings": {"process_start": process_start, "weights_start": weights.started,
                    "weights_done": weights.finished, "ready": ready, "generate_seconds": result.seconds,
                    "tokens_per_second": len(result.tokens) / max(result.seconds, 1e-9)}}, indent=2))
    return 0
