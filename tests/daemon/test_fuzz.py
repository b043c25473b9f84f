"""Property-based fuzzing of every WeightCache RPC against one real daemon process.

Each RPC gets random but well-typed requests (hypothesis): random strings with NUL bytes, huge
strings, edge and huge numbers, unknown dtypes and schemes, random ids, random chunk sequences; and
requests close to valid ones (the real checkpoint, the real session, a real lease, a real publish
stream broken one way), so that the calls also reach past the first check. The property: every call
either succeeds or fails with a status other than INTERNAL, UNKNOWN or DEADLINE_EXCEEDED (a hang),
with details that are the daemon's own error ("PlanError: ...", naming the problem), on one line,
without a traceback; and the model loaded first ("the anchor") stays listed with the same content
digest throughout. The bugs it found have regression tests at the end.

The run is derandomized (the same examples every run): about 20 s with 40 examples per RPC.
PRELOAD_FUZZ_EXAMPLES=2000 runs a long one (pytest -s prints how the calls ended); hypothesis
prints the smallest failing request it found, with placeholders such as "@checkpoint" standing for
values only known at run time (see Context.resolve)."""

import collections
import dataclasses
import functools
import os
import pathlib
import shutil
import tempfile

import grpc
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from preload_daemon.buffers import dtype_name
from preload_daemon.checkpoint import stat_identity
from preload_daemon.errors import STATUS_CODES
from preload_daemon.plan import LoadSpec
from protos import preload_pb2 as pb
from protos import preload_pb2_grpc as pb_grpc
from tests.conftest import DaemonHandle

EXAMPLES = int(os.environ.get("PRELOAD_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])  # anchor_survives runs per test on purpose
CALL_TIMEOUT = 20.0
ANCHOR = "fuzz-anchor"
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}

# Placeholders for values known only once the daemon runs; Context.resolve substitutes them.
CHECKPOINT = "@checkpoint"            # the tiny Llama's directory
CHECKPOINT_FILE = "@checkpoint/config.json"
SESSION = "@session"                  # the token of our open session
LEASE = "@lease"                      # the newest lease an Attach gave us
CREATED = "@created"                  # the newest model name a fuzzed LoadModel or PublishStream created
CONFIG = "@config"                    # the tiny Llama's config.json
FILES = "@files"                      # as FileIdentity.path: the checkpoint's real file identities


# -- the daemon, once for the module -----------------------------------------------------------------------


@dataclasses.dataclass(repr=False)  # hypothesis prints the arguments of a failing example: keep it short
class Context:
    daemon: DaemonHandle
    stub: pb_grpc.WeightCacheStub
    checkpoint: pathlib.Path
    session: str
    digest: str
    tensors: list[tuple[str, str, list[int], bytes]]  # the checkpoint's (name, dtype, shape, bytes)
    leases: list[str] = dataclasses.field(default_factory=list)
    created: list[str] = dataclasses.field(default_factory=list)
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """(rpc, status) -> calls: how deep the fuzz got, printed at the end (pytest -s)."""

    def resolve(self, message):
        """`message` with its placeholders replaced (in place), and returned."""
        values = {CHECKPOINT: str(self.checkpoint), CHECKPOINT_FILE: str(self.checkpoint / "config.json"),
                  SESSION: self.session, LEASE: self.leases[-1] if self.leases else "",
                  CREATED: self.created[-1] if self.created else "", CONFIG: self.config_json}
        _substitute(message, values)
        if isinstance(message, pb.AttachRequest) and any(f.path == FILES for f in message.files):
            del message.files[:]
            message.files.extend(pb.FileIdentity(**dataclasses.asdict(f)) for f in stat_identity(self.checkpoint))
        return message

    @functools.cached_property
    def config_json(self) -> str:
        return (self.checkpoint / "config.json").read_text()

    def __repr__(self) -> str:
        return "ctx"

    def _repr_pretty_(self, printer, cycle) -> None:  # what hypothesis's printer calls
        printer.text("ctx")


def _substitute(message, values: dict[str, str]) -> None:
    for field, value in message.ListFields():
        if field.type == field.TYPE_MESSAGE:
            for item in (value if field.is_repeated else [value]):
                _substitute(item, values)
        elif field.type == field.TYPE_STRING and not field.is_repeated and value in values:
            setattr(message, field.name, values[value])


@pytest.fixture(scope="module")
def ctx(tiny_llama):
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
    daemon = DaemonHandle(runtime)
    channel = grpc.insecure_channel(f"unix:{daemon.config.socket_path}",
                                    options=[("grpc.max_send_message_length", 64 << 20), ("grpc.enable_http_proxy", 0)])
    try:
        info = daemon.client.load(LoadSpec(path=str(tiny_llama), name=ANCHOR), timeout=60)
        context = Context(daemon, pb_grpc.WeightCacheStub(channel), tiny_llama, daemon.client.session(),
                          info.key.content_digest, read_tensors(tiny_llama / "model.safetensors"))
        yield context
        print("\nfuzzed calls by outcome:", *(f"  {rpc} {code}: {n}" for (rpc, code), n in sorted(
            context.outcomes.items())), sep="\n")
    finally:
        channel.close()
        daemon.stop()
        shutil.rmtree(daemon.config.shm_dir, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)


def read_tensors(path: pathlib.Path) -> list[tuple[str, str, list[int], bytes]]:
    """(name, dtype, shape, raw bytes) of each tensor, in file order: what a publisher streams."""
    out = []
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name).contiguous()
            raw = tensor.view(-1).view(torch.uint8).numpy().tobytes()
            out.append((name, dtype_name(tensor.dtype), list(tensor.shape), raw))
    return out


@pytest.fixture(autouse=True)
def anchor_survives(ctx):
    """After each RPC's run: the daemon runs and still holds the anchor, bit for bit."""
    yield
    assert ctx.daemon.proc.poll() is None, f"the daemon died:\n{ctx.daemon.output()[-3000:]}"
    assert_anchor_intact(ctx)


def assert_anchor_intact(ctx: Context) -> None:
    models = ctx.stub.ListModels(pb.ListModelsRequest(), timeout=CALL_TIMEOUT).models
    digests = [m.key.content_digest for m in models if m.name == ANCHOR and m.version == 1]
    assert ctx.digest in digests, f"{ANCHOR} v1 is gone or changed: {digests}"


# -- calling, and the property ----------------------------------------------------------------------------


def call(ctx: Context, rpc: str, request) -> object | None:
    """Calls `rpc` with `request` (placeholders resolved here) and checks the property; returns the
    response (the last message of a stream), or None if the call failed as it may. Remembers the
    leases and model names it got, for later requests."""
    request = [ctx.resolve(c) for c in request] if rpc == "PublishStream" else ctx.resolve(request)
    method = getattr(ctx.stub, rpc)
    try:
        if rpc == "LoadModel":
            response = (list(method(request, timeout=CALL_TIMEOUT)) or [None])[-1]
        elif rpc == "PublishStream":
            response = method(iter(request), timeout=CALL_TIMEOUT)
        else:
            response = method(request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        ctx.outcomes[rpc, f"{e.code().name} {(e.details() or '').partition(':')[0]}"] += 1
        check_failure(ctx, rpc, request, e.code(), e.details() or "")
        return None
    ctx.outcomes[rpc, "OK"] += 1
    if isinstance(response, pb.AttachResponse):
        ctx.leases.append(response.lease.id)
    for variant in getattr(response, "variants", ()):
        if variant.name not in ctx.created:
            ctx.created.append(variant.name)
    return response


def check_failure(ctx: Context, rpc: str, request, code: grpc.StatusCode, details: str) -> None:
    where = f"{rpc} -> {code.name}: {details[:500]!r}"
    assert code not in BAD_CODES, where
    assert "Traceback" not in details, f"a traceback in the details: {where}"
    assert details.partition(": ")[0] in ERROR_NAMES or code == grpc.StatusCode.RESOURCE_EXHAUSTED and \
        details.startswith("Received message larger than max"), f"not a daemon error naming the problem: {where}"
    assert "\n" not in details and "\r" not in details, f"not a one-line message: {where}"


ERROR_NAMES = {cls.__name__ for cls in STATUS_CODES}

def request_strings(message) -> list[str]:
    """Every string field of a request (or of a PublishStream's chunks), nested ones included."""
    if isinstance(message, list):  # a PublishStream's chunks
        return [s for chunk in message for s in request_strings(chunk)]
    out = []
    for field, value in message.ListFields():
        if field.type == field.TYPE_MESSAGE:
            for item in (value if field.is_repeated else [value]):
                out += request_strings(item)
        elif field.type == field.TYPE_STRING:
            out += list(value) if field.is_repeated else [value]
    return out


# -- strategies ------------------------------------------------------------------------------------------

_chars = st.characters(exclude_categories=("Cs",))  # protobuf strings are UTF-8: no lone surrogates
short_text = st.text(_chars, max_size=24)
strings = st.one_of(
    short_text,
    st.sampled_from(["", ".", "..", "/", "\x00", " ", "\n", "a/b", "../../etc/passwd", "%s%n{0}", "😀" * 8,
                     "-", "--force", "*", "v1", "a" * 255]),
    short_text.map(lambda s: f"{s}\x00{s}"),                     # NUL inside
    st.integers(4000, 70_000).map(lambda n: "x" * n),            # huge, around and past the limits
)
names = st.one_of(strings, st.just(CREATED)).filter(lambda s: s != ANCHOR)
names_or_anchor = st.one_of(names, st.just(ANCHOR))
u32 = st.one_of(st.integers(0, 3), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 3), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 1 << 40]), st.integers(0, 2**64 - 1))
i64 = st.one_of(st.integers(-2, 3), st.sampled_from([-2**63, 2**63 - 1, -1]), st.integers(-2**63, 2**63 - 1))
# Each field: mostly a value the daemon knows (so that calls get past the first check), else anything.
good_dtypes = st.sampled_from(["", "auto", "bfloat16", "float16", "float32"])
good_schemes = st.sampled_from(["", "none", "fp8_per_tensor", "fp8_per_channel", "fp8_block", "int8", "mxfp8", "mxfp4",
                                "nvfp4"])
good_components = st.sampled_from(["", "main", "draft"])
dtypes = st.one_of(good_dtypes, st.sampled_from(["float64", "float8_e4m3fn", "int8", "bool", "complex64",
                                                 "torch.float32", "BFLOAT16"]), strings)
schemes = st.one_of(good_schemes, st.just("NONE"), strings)
components = st.one_of(good_components, strings)
tp_sizes = st.one_of(st.integers(0, 4), u32)
tp_pairs = st.sampled_from([(0, 0), (1, 0), (2, 0), (2, 1)])  # (tp_size, tp_rank); 0 means 1
good_layouts = st.builds(lambda tp, **fields: pb.Layout(tp_size=tp[0], tp_rank=tp[1], **fields), tp_pairs,
                         dtype=good_dtypes, quantization=good_schemes, component=st.sampled_from(["", "main", "draft"]))
layouts = st.one_of(good_layouts, st.builds(pb.Layout, dtype=dtypes, quantization=schemes, tp_size=tp_sizes,
                                            tp_rank=tp_sizes, component=components))
layout_lists = st.one_of(st.lists(good_layouts, max_size=2), st.lists(layouts, max_size=3))

@st.composite
def retentions(draw) -> pb.Retention:
    retention = pb.Retention()
    if draw(st.booleans()):
        retention.keep = draw(u32)
    if draw(st.booleans()):
        retention.max_bytes = draw(u64)
    return retention


paths = st.one_of(st.just(CHECKPOINT), st.just(CHECKPOINT), strings,
                  st.sampled_from([CHECKPOINT_FILE, "/", "/proc/self", "/dev/null", "/dev/zero", "/etc/passwd",
                                   "relative/dir", "~", "/nonexistent/" + "d" * 300]))
load_requests = st.builds(
    pb.LoadModelRequest,
    spec=st.one_of(
        st.builds(lambda tp, **fields: pb.LoadSpec(tp_size=tp[0], tp_rank=tp[1], **fields), tp_pairs,
                  path=st.just(CHECKPOINT), name=names, dtype=good_dtypes, quantization=good_schemes),
        st.builds(pb.LoadSpec, path=paths, name=names, dtype=dtypes, quantization=schemes, tp_size=tp_sizes,
                  tp_rank=tp_sizes, component=components)),
    layouts=layout_lists, version=st.one_of(st.just(0), u32), activate=st.booleans(),
    retention=retentions())

file_identities = st.builds(pb.FileIdentity, path=st.one_of(strings, st.just(FILES)), size=u64, mtime_ns=i64,
                            inode=u64, header_sha256=strings)


@st.composite
def attach_requests(draw) -> pb.AttachRequest:
    request = pb.AttachRequest(
        model=draw(st.one_of(st.just(ANCHOR), st.just(ANCHOR), names_or_anchor)),
        version=draw(st.one_of(st.just(0), u32)),
        files=draw(st.lists(file_identities, max_size=3)),
        session=draw(st.one_of(st.just(SESSION), st.just(SESSION), strings, st.text("0123456789abcdef", min_size=32,
                                                                                       max_size=32))))
    if draw(st.booleans()):
        request.layout.CopyFrom(draw(layouts))
    return request


lease_ids = st.one_of(st.just(LEASE), strings, st.text("0123456789abcdef", min_size=1, max_size=65))

# PublishStream: random chunk sequences with random headers (tensor sizes kept small or past the
# daemon's limit: a slab is allocated before the data arrives, and a plausible 10 GB one would be real).
dims = st.one_of(st.integers(0, 16), st.integers(-2**63, -1), st.integers(2**41, 2**63 - 1))
shapes = st.one_of(st.lists(st.integers(0, 16), max_size=3), st.lists(st.sampled_from([0, 1, 2]), min_size=9,
                                                                      max_size=10), st.lists(dims, max_size=3))
tensor_specs = st.builds(pb.TensorSpec, name=strings, dtype=dtypes, shape=shapes)
configs = st.one_of(st.just(CONFIG), strings, st.sampled_from(
    ["{}", "[]", "null", "1e999", '{"architectures": 5}', '{"architectures": ["LlamaForCausalLM"]}',
     '{"architectures": ["LlamaForCausalLM"], "hidden_size": -1, "num_hidden_layers": 1e300}', "{" * 10_000]))
headers = st.builds(pb.PublishHeader, model=names, version=u32, config_json=configs,
                    tensors=st.lists(tensor_specs, max_size=4), layouts=layout_lists,
                    activate=st.booleans(), retention=retentions(), label=strings)
tensor_data = st.builds(pb.TensorData, index=st.one_of(st.integers(0, 4), u32),
                        offset=st.one_of(st.integers(0, 64), u64),
                        data=st.binary(max_size=256))
random_chunks = st.lists(st.one_of(headers.map(lambda h: pb.PublishChunk(header=h)),
                                   tensor_data.map(lambda d: pb.PublishChunk(data=d))), max_size=6)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A real publish stream of the tiny Llama (real config and tensors), broken by `mutation`."""

    header: pb.PublishHeader  # model, version, layouts, activate, retention, label; tensors and config are real
    chunk_bytes: int
    mutation: str
    at: int  # which tensor or chunk the mutation hits
    value: int


MUTATIONS = ("none", "truncate", "drop_tensor_spec", "shape", "dtype", "index", "offset", "extra_bytes",
             "second_header", "data_first", "duplicate_chunk", "rename_tensor", "duplicate_tensor_spec")
recipes = st.builds(Recipe, header=st.builds(pb.PublishHeader, model=names, version=st.one_of(st.just(0), u32),
                                             layouts=layout_lists, activate=st.booleans(),
                                             retention=retentions(), label=strings),
                    chunk_bytes=st.sampled_from([1 << 20, 4096, 97]), mutation=st.sampled_from(MUTATIONS),
                    at=st.integers(0, 1000), value=st.sampled_from([0, 2, -1, 2**50, 3]))


def build_stream(ctx: Context, recipe: Recipe) -> list[pb.PublishChunk]:
    header = pb.PublishHeader()
    header.CopyFrom(recipe.header)
    header.config_json = CONFIG
    specs = [pb.TensorSpec(name=n, dtype=d, shape=s) for n, d, s, _ in ctx.tensors]
    k = recipe.at % len(specs)
    if recipe.mutation == "drop_tensor_spec":
        del specs[k]
    elif recipe.mutation == "duplicate_tensor_spec":
        specs.append(specs[k])
    elif recipe.mutation == "rename_tensor":
        specs[k].name = "model.layers.99.self_attn.q_proj.weight"
    elif recipe.mutation == "dtype":
        specs[k].dtype = "float16" if specs[k].dtype != "float16" else "int8"
    elif recipe.mutation == "shape" and specs[k].shape:
        specs[k].shape[recipe.at % len(specs[k].shape)] = recipe.value
    header.tensors.extend(specs)
    chunks = [pb.PublishChunk(data=pb.TensorData(index=i, offset=o, data=raw[o:o + recipe.chunk_bytes]))
              for i, (_, _, _, raw) in enumerate(ctx.tensors) for o in range(0, len(raw), recipe.chunk_bytes)]
    j = recipe.at % len(chunks)
    if recipe.mutation == "truncate":
        chunks = chunks[:j]
    elif recipe.mutation == "index":
        chunks[j].data.index = max(recipe.value, 0) % 2**32
    elif recipe.mutation == "offset":
        chunks[j].data.offset = max(recipe.value, 0) % 2**64
    elif recipe.mutation == "extra_bytes":
        chunks[j].data.data += b"\0" * 8
    elif recipe.mutation == "duplicate_chunk":
        chunks.insert(j, chunks[j])
    elif recipe.mutation == "second_header":
        chunks.insert(j, pb.PublishChunk(header=header))
    stream = [pb.PublishChunk(header=header), *chunks]
    return stream[1:] if recipe.mutation == "data_first" else stream


# -- one test per RPC --------------------------------------------------------------------------------------


@FUZZ
@given(request=load_requests)
def test_load_model(ctx, request):
    call(ctx, "LoadModel", request)


@FUZZ
@given(chunks=random_chunks)
def test_publish_stream_random_chunks(ctx, chunks):
    call(ctx, "PublishStream", chunks)


@FUZZ
@given(recipe=recipes)
def test_publish_stream_broken_real_stream(ctx, recipe):
    call(ctx, "PublishStream", build_stream(ctx, recipe))


@FUZZ
@given(request=attach_requests())
@example(request=pb.AttachRequest(model=ANCHOR, session=SESSION, files=[pb.FileIdentity()] * 100_001))  # past MAX_FILES
def test_attach(ctx, request):
    call(ctx, "Attach", request)


@FUZZ
@given(lease_id=lease_ids)
def test_renew_lease(ctx, lease_id):
    call(ctx, "RenewLease", pb.RenewLeaseRequest(lease_id=lease_id))


@FUZZ
@given(lease_id=lease_ids)
def test_release(ctx, lease_id):
    call(ctx, "Release", pb.ReleaseRequest(lease_id=lease_id))


@FUZZ
@given(model=names, version=u32)
def test_set_active(ctx, model, version):
    call(ctx, "SetActive", pb.SetActiveRequest(model=model, version=version))


@FUZZ
@given(model=names_or_anchor, version=u32, pinned=st.booleans())
def test_pin(ctx, model, version, pinned):
    call(ctx, "Pin", pb.PinRequest(model=model, version=version, pinned=pinned))


@FUZZ
@given(model=names, version=u32)
def test_evict_without_force(ctx, model, version):
    call(ctx, "Evict", pb.EvictRequest(model=model, version=version, force=False))


@FUZZ
@given(model=names_or_anchor, version=u32)
def test_verify(ctx, model, version):
    response = call(ctx, "Verify", pb.VerifyRequest(model=model, version=version))
    if response is not None:
        assert all(check.ok for check in response.slabs), response


RPC_STRATEGIES = {
    "LoadModel": load_requests, "Attach": attach_requests(),
    "RenewLease": lease_ids.map(lambda i: pb.RenewLeaseRequest(lease_id=i)),
    "Release": lease_ids.map(lambda i: pb.ReleaseRequest(lease_id=i)),
    "SetActive": st.builds(pb.SetActiveRequest, model=names, version=u32),
    "Pin": st.builds(pb.PinRequest, model=names_or_anchor, version=u32, pinned=st.booleans()),
    "Evict": st.builds(pb.EvictRequest, model=names, version=u32, force=st.just(False)),
    "Verify": st.builds(pb.VerifyRequest, model=names_or_anchor, version=u32),
    "PublishStream": random_chunks,
}


@FUZZ
@given(steps=st.lists(st.sampled_from(sorted(RPC_STRATEGIES)).flatmap(
    lambda rpc: RPC_STRATEGIES[rpc].map(lambda request: (rpc, request))), max_size=4))
def test_stats_and_list_after_random_calls(ctx, steps):
    """GetStats and ListModels (which take no fields) after random sequences of the other RPCs:
    they answer, and what they say adds up."""
    for rpc, request in steps:
        call(ctx, rpc, request)
    stats = call(ctx, "GetStats", pb.GetStatsRequest())
    listing = call(ctx, "ListModels", pb.ListModelsRequest())
    assert stats is not None and listing is not None, "GetStats or ListModels failed"
    assert stats.resident_bytes >= sum(m.slab_bytes for m in stats.models) > 0
    assert {(m.name, m.version) for m in listing.models} <= {(s.name, v.version) for s in listing.summaries
                                                            for v in s.versions}


def test_every_rpc_is_fuzzed():
    """A new RPC in preload.proto fails here until it gets a strategy above."""
    fuzzed = set(RPC_STRATEGIES) | {"GetStats", "ListModels"}
    assert {m.name for m in pb.DESCRIPTOR.services_by_name["WeightCache"].methods} <= fuzzed


# -- regressions the fuzz found (each failed before its fix) ---------------------------------------------


def failure(ctx: Context, rpc: str, request) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a call that must fail."""
    try:
        call_raw = getattr(ctx.stub, rpc)
        if rpc == "LoadModel":
            list(call_raw(request, timeout=CALL_TIMEOUT))
        else:
            call_raw(iter(request) if rpc == "PublishStream" else request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    raise AssertionError(f"{rpc} succeeded")


def publish_header(**fields) -> pb.PublishChunk:
    return pb.PublishChunk(header=pb.PublishHeader(**{"model": "m", "config_json": CONFIG, **fields}))


ECHOED = {  # a string of the request with a line break, which the error quotes
    "lease-id": ("Release", pb.ReleaseRequest(lease_id="a\nb")),
    "renewed-lease-id": ("RenewLease", pb.RenewLeaseRequest(lease_id="a\nb")),
    "publish-label": ("PublishStream", [publish_header(label="a\nb", config_json="")]),
    "publish-tensor-name": ("PublishStream", [publish_header(tensors=[pb.TensorSpec(name="a\nb", dtype="float32")])]),
    "load-path": ("LoadModel", pb.LoadModelRequest(spec=pb.LoadSpec(path="/nonexistent/a\nb"))),
    "model-name-in-version-range": ("LoadModel", pb.LoadModelRequest(spec=pb.LoadSpec(path=CHECKPOINT, name="a\nb"),
                                                                     version=2**31)),
    "model-name-in-budget": ("LoadModel", pb.LoadModelRequest(spec=pb.LoadSpec(path=CHECKPOINT, name="a\nb"),
                                                              retention=pb.Retention(max_bytes=10))),
    "attach-file-path": ("Attach", pb.AttachRequest(model=ANCHOR, session=SESSION,
                                                    files=[pb.FileIdentity(path="a\nb")])),
}


@pytest.mark.parametrize("case", sorted(ECHOED))
def test_a_line_break_in_a_request_string_never_breaks_the_message(ctx, case):
    rpc, request = ECHOED[case]
    resolved = [ctx.resolve(c) for c in request] if rpc == "PublishStream" else ctx.resolve(request)
    code, details = failure(ctx, rpc, resolved)
    assert "\n" not in details, f"{rpc} -> {code.name}: {details!r}"


def test_a_long_unknown_dtype_still_gets_its_error_through_grpc(ctx):
    request = pb.LoadModelRequest(spec=pb.LoadSpec(path=str(ctx.checkpoint), dtype="😀" * 2000))
    code, details = failure(ctx, "LoadModel", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("PlanError: unknown dtype"), details


def test_a_publish_refused_mid_stream_ends_with_its_error_not_cancelled(ctx):
    """A second header once data flows; five times (the cancel races the error), under fresh names."""
    for attempt in range(5):
        recipe = Recipe(header=pb.PublishHeader(model=f"second-header-{attempt}"), chunk_bytes=1 << 20,
                        mutation="second_header", at=1, value=0)
        code, details = failure(ctx, "PublishStream", [ctx.resolve(c) for c in build_stream(ctx, recipe)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "one header" in details, f"{code.name}: {details!r}"


def test_a_relative_checkpoint_path_is_refused_not_resolved_against_the_daemons_directory(ctx):
    """The daemon's working directory is not the caller's: a relative path over raw gRPC named some
    other directory (the CLI and DaemonClient send absolute ones)."""
    request = pb.LoadModelRequest(spec=pb.LoadSpec(path=os.path.relpath(ctx.checkpoint)))
    code, details = failure(ctx, "LoadModel", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "is relative; send the checkpoint directory's absolute" \
        in details, details
