from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: LoadSpec
    def __init__(self, spec: _Optional[_Union[LoadSpec, _Mapping]] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("stage", "bytes_done", "bytes_total", "tensors_done", "tensors_total", "model")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_DONE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    model: ModelInfo
    def __init__(self, stage: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., tensors_done: _Optional[int] = ..., tensors_total: _Optional[int] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class FileIdentity(_message.Message):
    __slots__ = ("path", "size", "mtime_ns", "inode", "header_sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    HEADER_SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    mtime_ns: int
    inode: int
    header_sha256: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., inode: _Optional[int] = ..., header_sha256: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("name", "version", "active", "state", "path", "key", "slab_bytes", "num_tensors", "leases", "loaded_at", "load_seconds", "stale_reason")
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
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., active: _Optional[bool] = ..., state: _Optional[str] = ..., path: _Optional[str] = ..., key: _Optional[_Union[CacheKey, _Mapping]] = ..., slab_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., loaded_at: _Optional[float] = ..., load_seconds: _Optional[float] = ..., stale_reason: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model", "version", "expect", "check_expect")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    CHECK_EXPECT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    expect: CacheKey
    check_expect: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., expect: _Optional[_Union[CacheKey, _Mapping]] = ..., check_expect: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("manifest", "lease")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    lease: Lease
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("device", "pid", "started_at", "resident_bytes", "num_leases", "models", "serving", "runtime_dir", "version")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    device: str
    pid: int
    started_at: float
    resident_bytes: int
    num_leases: int
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    serving: bool
    runtime_dir: str
    version: str
    def __init__(self, device: _Optional[str] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ..., resident_bytes: _Optional[int] = ..., num_leases: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., serving: _Optional[bool] = ..., runtime_dir: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
