"""The cache key (docs/architecture.md, Protocol): everything that decides the bytes of a slab. A mismatch is
reported by naming the fields that differ."""

import dataclasses

from preload_daemon.safetensors_file import FileIdentity
from protos import preload_pb2 as pb


@dataclasses.dataclass(frozen=True, slots=True)
class CacheKey:
    files: tuple[FileIdentity, ...]
    architecture: str
    tp_size: int
    tp_rank: int
    dtype: str
    quantization: str
    component: str
    format_version: int
    quant_params: tuple[tuple[str, str], ...] = ()
    content_digest: str = ""

    def differences(self, expected: "CacheKey") -> list[str]:
        """Fields of `expected` that this key does not match. An empty content digest in `expected`
        means "not checked" (a caller that has not read the weights cannot know it)."""
        diffs = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(expected, field.name)
            if field.name == "files":
                diffs += file_differences(mine, theirs)
            elif field.name == "content_digest" and not theirs:
                continue
            elif mine != theirs:
                diffs.append(f"{field.name} ({mine!r} here, {theirs!r} expected)")
        return diffs

    def to_dict(self) -> dict:
        """The key as plain JSON values (a snapshot's manifest records it)."""
        return {**dataclasses.asdict(self), "files": [dataclasses.asdict(f) for f in self.files],
                "quant_params": [list(p) for p in self.quant_params]}

    def to_proto(self) -> pb.CacheKey:
        return pb.CacheKey(
            files=[pb.FileIdentity(**dataclasses.asdict(f)) for f in self.files],
            content_digest=self.content_digest, architecture=self.architecture, tp_size=self.tp_size,
            tp_rank=self.tp_rank, dtype=self.dtype, quantization=self.quantization,
            quant_params=dict(self.quant_params), component=self.component, format_version=self.format_version)

    @classmethod
    def from_proto(cls, msg: pb.CacheKey) -> "CacheKey":
        return cls(
            files=tuple(file_identity(f) for f in msg.files),
            architecture=msg.architecture, tp_size=msg.tp_size, tp_rank=msg.tp_rank, dtype=msg.dtype,
            quantization=msg.quantization, component=msg.component, format_version=msg.format_version,
            quant_params=tuple(sorted(msg.quant_params.items())), content_digest=msg.content_digest)


def file_identity(msg: pb.FileIdentity) -> FileIdentity:
    return FileIdentity(msg.path, msg.size, msg.mtime_ns, msg.inode, msg.header_sha256, msg.ctime_ns, msg.device)


def file_differences(mine: tuple[FileIdentity, ...], theirs: tuple[FileIdentity, ...]) -> list[str]:
    """'files[NAME].FIELD' for each file field that differs, plus files present on one side only."""
    by_path = {f.path: f for f in theirs}
    diffs = []
    for f in mine:
        other = by_path.pop(f.path, None)
        if other is None:
            diffs.append(f"files[{f.path}] (not expected)")
        else:
            diffs += [f"files[{f.path}].{name}" for name in f.differences(other)]
    diffs += [f"files[{path}] (missing here)" for path in by_path]
    return diffs
