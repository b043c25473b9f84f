"""The config.json numbers that tensor shapes and TP sharding depend on."""

import dataclasses

from preload_daemon.errors import CheckpointError, PlanError


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """The slice of the source tensor this rank keeps: `length` rows/columns from `start` along `dim`."""

    dim: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class ModelDims:
    """The config.json numbers that shapes and sharding depend on."""

    path: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_layers: int

    @classmethod
    def from_config(cls, config: dict, path) -> "ModelDims":
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(str(path), hidden, heads, int(config.get("num_key_value_heads") or heads),
                       int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                       int(config["vocab_size"]), int(config["num_hidden_layers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}/config.json: missing or bad field {e}; it needs hidden_size, "
                                  "num_attention_heads, intermediate_size, vocab_size, num_hidden_layers") from e

    def check_tp(self, tp: int) -> None:
        problems = []
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} (nor does it divide {tp})")
        if self.intermediate % tp:
            problems.append(f"intermediate_size={self.intermediate}")
        if self.vocab % tp:
            problems.append(f"vocab_size={self.vocab}")
        if problems:
            raise PlanError(f"{self.path}: tp_size {tp} does not divide {', '.join(problems)}; pick a TP size "
                            "that divides the head counts")

    def check_shape(self, name: str, role: str, shape: tuple[int, ...]) -> None:
        expected = self._expected(name, role)
        if expected is not None and tuple(shape) != expected:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(shape)} but config.json implies "
                                  f"{list(expected)}; the config does not belong to these weights")

    def _expected(self, name: str, role: str) -> tuple[int, ...] | None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        table = {
            "q_proj.weight": (q, self.hidden), "k_proj.weight": (kv, self.hidden),
            "v_proj.weight": (kv, self.hidden), "o_proj.weight": (self.hidden, q),
            "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
            "gate_proj.weight": (self.intermediate, self.hidden), "up_proj.weight": (self.intermediate, self.hidden),
            "down_proj.weight": (self.hidden, self.intermediate),
            "q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,),
        }
        for suffix, shape in table.items():
            if name.endswith(suffix):
                return shape
        if role in ("embedding", "lm_head"):
            return (self.vocab, self.hidden)
        if role == "norm":
            return (self.hidden,)
        return None

    def shard(self, style: str, shape: tuple[int, ...], tp: int, rank: int) -> Shard | None:
        if tp == 1 or style == "replicated":
            return None
        if style in ("column", "vocab"):
            return Shard(0, rank * shape[0] // tp, shape[0] // tp)
        if style == "row":
            return Shard(1, rank * shape[1] // tp, shape[1] // tp)
        # kv: split by heads; with fewer kv heads than ranks, each rank keeps one (replicated) head.
        if self.num_kv_heads >= tp:
            return Shard(0, rank * shape[0] // tp, shape[0] // tp)
        head = rank * self.num_kv_heads // tp
        return Shard(0, head * self.head_dim, self.head_dim)
