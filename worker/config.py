"""The engine worker's configuration: one frozen dataclass per process, resolved once by the CLI."""

import dataclasses
import pathlib

from preload_daemon.arch import ArchSpec
from preload_daemon.config import MAX_THREADS
from preload_daemon.errors import InvalidRequestError
from preload_daemon.hfconfig import read_config

MAX_SPECULATIVE = 16


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class EngineConfig:
    """Everything one engine process (one TP rank of one DP replica) needs to know."""

    model: pathlib.Path
    """Checkpoint directory (the cold path reads it; ipc_cache derives the cache key from it)."""
    name: str = ""
    """Model name in the daemon; defaults to the directory's base name."""
    load_format: str = "ipc_cache"
    fallback: bool = True
    """With ipc_cache: load cold when the daemon cannot serve the weights."""
    devices: tuple[str, ...] = ("cpu:0",)
    """One device per TP rank; rank r attaches to the daemon of devices[r]."""
    dtype: str = "auto"
    quantization: str = "none"
    runtime_dir: pathlib.Path | None = None
    max_batch: int = 8
    """Concurrent sequences (KV cache slots)."""
    max_model_len: int = 2048
    prefill_chunk: int = 256
    """Prompt tokens a step prefills of a long prompt arriving while others decode (0: whole)."""
    tp_size: int = 1
    tp_rank: int = 0
    tp_step_timeout: float = 120.0
    """Seconds after which a step stuck on another rank (stopped, or none at work) ends the engine (0: never)."""
    rendezvous_addr: str = "127.0.0.1"
    rendezvous_port: int = 0
    """Rank 0's TCP store, on rendezvous_addr; rank 0's command picks it and gives it to the others."""
    rendezvous_env: bool = False
    """Started by torchrun: join through its environment (env://) instead."""
    replica: int = 0
    """Index of this data-parallel replica (for logs and metrics)."""
    num_threads: int = 0
    """Compute threads for this process; 0 leaves torch's default."""
    weights_version: str = ""
    """With ipc_cache: "" attaches to the version loaded from `model`'s files, "active" to the name's
    active version, a number to that version."""
    allow_external_links: bool = False
    """A cold load may read checkpoint files that link outside the model directory."""
    wait_for_daemon: float = 0.0
    """With ipc_cache: seconds to wait for a daemon that is absent or still loading before falling back."""
    speculative: str = ""
    """"" (none), "mtp" (the checkpoint's MTP layers) or "draft" (the separate `draft_model`)."""
    num_speculative_tokens: int = 1
    """Tokens the draft proposes per step (K)."""
    draft_model: pathlib.Path | None = None
    """The draft checkpoint of --speculative draft (same tokenizer and vocabulary)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidRequestError(f"TP rank {self.tp_rank} is not in [0, --tp-size {self.tp_size})")
        if len(self.devices) != self.tp_size or len(set(self.devices)) != self.tp_size:
            raise InvalidRequestError(f"--devices lists {len(self.devices)} device(s) ({','.join(self.devices)}) "
                                      f"for --tp-size {self.tp_size}; give one distinct device per rank")
        if self.max_batch < 1 or self.max_model_len < 2:
            raise InvalidRequestError("--max-batch must be >= 1 and --max-model-len >= 2")
        if self.prefill_chunk < 0:
            raise InvalidRequestError(f"--prefill-chunk must be >= 0 (0: prefill every prompt whole), "
                                      f"got {self.prefill_chunk}")
        if not 0 <= self.num_threads <= MAX_THREADS:
            raise InvalidRequestError(f"--threads must be 0..{MAX_THREADS} (0: the cores divided among the "
                                      f"processes), got {self.num_threads}")
        if not self.name:
            object.__setattr__(self, "name", self.model.name)
        if self.weights_version not in ("", "active") and not (self.weights_version.isdigit()
                                                                and 0 < int(self.weights_version) < 2**32):
            raise InvalidRequestError(f"--weights-version {self.weights_version!r}: give a version number "
                                      "(see `preload status`) or 'active'")
        if self.weights_version and self.load_format != "ipc_cache":
            raise InvalidRequestError("--weights-version picks a version held by the daemon; it needs "
                                      "--load-format ipc_cache")
        if self.speculative not in ("", "mtp", "draft"):
            raise InvalidRequestError(f"--speculative {self.speculative!r}: choose mtp or draft")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise InvalidRequestError("--speculative draft and --draft-model DIR go together (--speculative mtp uses "
                                      "the checkpoint's own MTP layers)")
        if self.speculative and not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE:
            raise InvalidRequestError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE}], got "
                                      f"{self.num_speculative_tokens}")
        if not 0 <= self.wait_for_daemon <= 86400:
            raise InvalidRequestError(f"--wait-for-daemon must be 0..86400 seconds, got {self.wait_for_daemon:g}")

    @property
    def device(self) -> str:
        return self.devices[self.tp_rank]

    def check_fits(self) -> None:
        """Refuses a TP size the model (or its separate draft) cannot be split into, before any process
        starts or byte loads (a draft that did not fit failed on every rank, after the main weights)."""
        for model in (self.model, self.draft_model if self.speculative == "draft" else None):
            if model is not None:
                ArchSpec.from_config(read_config(model), f"{model}/config.json").check_tp(self.tp_size,
                                                                                         self.quantization)

    def load_spec(self):
        from preload_daemon.plan import LoadSpec  # torch: not needed to start the other ranks

        return LoadSpec(path=str(self.model), name=self.name, dtype=self.dtype, quantization=self.quantization,
                        tp_size=self.tp_size, tp_rank=self.tp_rank)
