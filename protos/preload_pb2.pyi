from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("dtype", "quantization", "tp_size", "tp_rank", "component")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    quantization: str
    tp_size: int
    tp_rank: int
    component: str
    def __init__(self, dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., component: _Optional[str] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("keep", "max_bytes")
    KEEP_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    keep: int
    max_bytes: int
    def __init__(self, keep: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class LoadSpec(_message.Message):
    __slots__ = ("path", "name", "dtype", "quantization", "tp_size", "tp_rank", "component")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    path: str
    name: str
    dtype: str
    quantization: str
    tp_size: int
    tp_rank: int
    component: str
    def __init__(self, path: _Optional[str] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., component: _Optional[str] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("spec", "layouts", "version", "activate", "retention")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    spec: LoadSpec
    layouts: _containers.RepeatedCompositeFieldContainer[Layout]
    version: int
    activate: bool
    retention: Retention
    def __init__(self, spec: _Optional[_Union[LoadSpec, _Mapping]] = ..., layouts: _Optional[_Iterable[_Union[Layout, _Mapping]]] = ..., version: _Optional[int] = ..., activate: _Optional[bool] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("stage", "bytes_done", "bytes_total", "tensors_done", "tensors_total", "model", "variants")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_DONE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    model: ModelInfo
    variants: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, stage: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., tensors_done: _Optional[int] = ..., tensors_total: _Optional[int] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., variants: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    data: TensorData
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., data: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("model", "version", "config_json", "tensors", "layouts", "activate", "retention", "label")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    config_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    layouts: _containers.RepeatedCompositeFieldContainer[Layout]
    activate: bool
    retention: Retention
    label: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., config_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[Layout, _Mapping]]] = ..., activate: _Optional[bool] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ..., label: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("variants",)
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    variants: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, variants: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class SetActiveRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model", "version", "pinned")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    pinned: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class FileIdentity(_message.Message):
    __slots__ = ("path", "size", "mtime_ns", "inode", "header_sha256", "ctime_ns", "device")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    HEADER_SHA256_FIELD_NUMBER: _ClassVar[int]
    CTIME_NS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    mtime_ns: int
    inode: int
    header_sha256: str
    ctime_ns: int
    device: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., inode: _Optional[int] = ..., header_sha256: _Optional[str] = ..., ctime_ns: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class CacheKey(_message.Message):
    __slots__ = ("files", "content_digest", "architecture", "tp_size", "tp_rank", "dtype", "quantization", "quant_params", "component", "format_version")
    class QuantParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    QUANT_PARAMS_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[FileIdentity]
    content_digest: str
    architecture: str
    tp_size: int
    tp_rank: int
    dtype: str
    quantization: str
    quant_params: _containers.ScalarMap[str, str]
    component: str
    format_version: int
    def __init__(self, files: _Optional[_Iterable[_Union[FileIdentity, _Mapping]]] = ..., content_digest: _Optional[str] = ..., architecture: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., quant_params: _Optional[_Mapping[str, str]] = ..., component: _Optional[str] = ..., format_version: _Optional[int] = ...) -> None: ...

class Slab(_message.Message):
    __slots__ = ("id", "backend", "size", "handle", "path", "device_uuid", "digest")
    ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    id: str
    backend: str
    size: int
    handle: bytes
    path: str
    device_uuid: str
    digest: str
    def __init__(self, id: _Optional[str] = ..., backend: _Optional[str] = ..., size: _Optional[int] = ..., handle: _Optional[bytes] = ..., path: _Optional[str] = ..., device_uuid: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "slab", "offset", "dtype", "shape", "role", "quant_scheme", "quant_params", "nbytes", "part")
    class QuantParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUANT_SCHEME_FIELD_NUMBER: _ClassVar[int]
    QUANT_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    name: str
    slab: str
    offset: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    role: str
    quant_scheme: str
    quant_params: _containers.ScalarMap[str, str]
    nbytes: int
    part: str
    def __init__(self, name: _Optional[str] = ..., slab: _Optional[str] = ..., offset: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., role: _Optional[str] = ..., quant_scheme: _Optional[str] = ..., quant_params: _Optional[_Mapping[str, str]] = ..., nbytes: _Optional[int] = ..., part: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("model", "version", "key", "slabs", "tensors", "config_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLABS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    key: CacheKey
    slabs: _containers.RepeatedCompositeFieldContainer[Slab]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    config_json: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., key: _Optional[_Union[CacheKey, _Mapping]] = ..., slabs: _Optional[_Iterable[_Union[Slab, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., config_json: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "pid", "pid_start_time", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_START_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    pid: int
    pid_start_time: float
    created_at: float
    def __init__(self, id: _Optional[str] = ..., pid: _Optional[int] = ..., pid_start_time: _Optional[float] = ..., created_at: _Optional[float] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "active", "state", "path", "key", "slab_bytes", "num_tensors", "leases", "loaded_at", "load_seconds", "stale_reason", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STALE_REASON_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    active: bool
    state: str
    path: str
    key: CacheKey
    slab_bytes: int
    num_tensors: int
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    loaded_at: float
    load_seconds: float
    stale_reason: str
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., active: _Optional[bool] = ..., state: _Optional[str] = ..., path: _Optional[str] = ..., key: _Optional[_Union[CacheKey, _Mapping]] = ..., slab_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., loaded_at: _Optional[float] = ..., load_seconds: _Optional[float] = ..., stale_reason: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class VersionSummary(_message.Message):
    __slots__ = ("version", "active", "pinned", "state", "source", "bytes", "num_variants", "num_leases", "created_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    version: int
    active: bool
    pinned: bool
    state: str
    source: str
    bytes: int
    num_variants: int
    num_leases: int
    created_at: float
    def __init__(self, version: _Optional[int] = ..., active: _Optional[bool] = ..., pinned: _Optional[bool] = ..., state: _Optional[str] = ..., source: _Optional[str] = ..., bytes: _Optional[int] = ..., num_variants: _Optional[int] = ..., num_leases: _Optional[int] = ..., created_at: _Optional[float] = ...) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("name", "active_version", "last_version", "versions", "keep", "max_bytes", "failures")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    active_version: int
    last_version: int
    versions: _containers.RepeatedCompositeFieldContainer[VersionSummary]
    keep: int
    max_bytes: int
    failures: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., active_version: _Optional[int] = ..., last_version: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[VersionSummary, _Mapping]]] = ..., keep: _Optional[int] = ..., max_bytes: _Optional[int] = ..., failures: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "summaries")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    summaries: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., summaries: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model", "version", "layout", "files", "session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layout: Layout
    files: _containers.RepeatedCompositeFieldContainer[FileIdentity]
    session: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., files: _Optional[_Iterable[_Union[FileIdentity, _Mapping]]] = ..., session: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("manifest", "lease")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    lease: Lease
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "session")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    session: str
    def __init__(self, lease_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "session")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    session: str
    def __init__(self, lease_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("model", "version", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    force: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., force: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, evicted: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("device", "pid", "started_at", "resident_bytes", "num_leases", "models", "serving", "runtime_dir", "version", "summaries", "num_sessions", "recovery", "adoption_seconds", "adopted_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    ADOPTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    pid: int
    started_at: float
    resident_bytes: int
    num_leases: int
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    serving: bool
    runtime_dir: str
    version: str
    summaries: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    num_sessions: int
    recovery: _containers.RepeatedScalarFieldContainer[str]
    adoption_seconds: float
    adopted_bytes: int
    def __init__(self, device: _Optional[str] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ..., resident_bytes: _Optional[int] = ..., num_leases: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., serving: _Optional[bool] = ..., runtime_dir: _Optional[str] = ..., version: _Optional[str] = ..., summaries: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., num_sessions: _Optional[int] = ..., recovery: _Optional[_Iterable[str]] = ..., adoption_seconds: _Optional[float] = ..., adopted_bytes: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SlabCheck(_message.Message):
    __slots__ = ("model", "version", "layout", "slab", "expected", "actual", "ok")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layout: Layout
    slab: str
    expected: str
    actual: str
    ok: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., slab: _Optional[str] = ..., expected: _Optional[str] = ..., actual: _Optional[str] = ..., ok: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("slabs", "seconds")
    SLABS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    slabs: _containers.RepeatedCompositeFieldContainer[SlabCheck]
    seconds: float
    def __init__(self, slabs: _Optional[_Iterable[_Union[SlabCheck, _Mapping]]] = ..., seconds: _Optional[float] = ...) -> None: ...
