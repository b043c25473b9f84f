"""A snapshot's manifest: written atomically, read with its shape and ownership checked (CRIU
restores as root from the files beside it), and checked against this host and the daemon before a
restore (worker/snapshot.py); and what an engine's /ready must say for a create to snapshot it."""

import json
import os
import pathlib
import re
import secrets
import shutil
import stat

from preload_daemon.errors import InvalidRequestError
from preload_daemon.runtime_dir import check_ancestors, socket_path
from worker.criu import SnapshotError, host_facts
from worker.snapshot_images import IMAGES

MANIFEST = "manifest.json"
FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 20


def check_ours(path: pathlib.Path) -> None:
    """A snapshot runs as root: its files must be ours and not writable by anyone else."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SnapshotError(f"{path} must be owned by uid {os.geteuid()}, not a symlink, and not writable by group or "
                            f"others (it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); a snapshot someone "
                            "else can change is code they could run as you")
    try:  # nor may anyone else swap it: the directories above it are trusted too
        check_ancestors(path, "move the snapshot under directories only you (or root) can write")
    except InvalidRequestError as e:
        raise SnapshotError(str(e)) from None


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_manifest(directory: pathlib.Path) -> dict:
    """The snapshot's manifest, checked for shape and ownership (restore runs CRIU on the images
    as root: a snapshot directory someone else can write is refused)."""
    directory = pathlib.Path(directory).absolute()
    path = directory / MANIFEST
    if not path.is_file():
        raise SnapshotError(f"{directory} is not a snapshot (no {MANIFEST}; a create that did not finish leaves none)")
    if not (directory / IMAGES).is_dir() or (directory / IMAGES).is_symlink():
        raise SnapshotError(f"{directory} has no {IMAGES} directory; the snapshot is incomplete: take a new one")
    for p in (directory, path, directory / IMAGES):
        check_ours(p)
    for p in (directory / IMAGES).iterdir():  # CRIU reads each of them as root
        check_ours(p)
        if not stat.S_ISREG(os.lstat(p).st_mode):
            raise SnapshotError(f"{p} is not a regular file; a snapshot's images are CRIU's files only")
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise SnapshotError(f"{path} is over {MAX_MANIFEST_BYTES} bytes; not a preload snapshot manifest")
    try:
        manifest = json.loads(data)
        if manifest.get("format") != FORMAT:
            raise SnapshotError(f"{path} is snapshot format {manifest.get('format')!r}; this preload reads {FORMAT}")
        engine, model, canary = manifest["engine"], manifest["engine"]["model"], manifest["canary"]
        for value, kind, what in ((manifest["host"], dict, "host"), (engine["listen"], dict, "engine.listen"),
                                  (model["name"], str, "model name"), (model["version"], int, "model version"),
                                  (model["cache_key"], dict, "cache key"), (engine["wake_fd"], int, "wake fd"),
                                  (engine["pid"], int, "pid"), (canary["tokens"], list, "canary tokens"),
                                  (manifest["image"], dict, "image"), (engine["device"], str, "device"),
                                  *((model["cache_key"].get(k, 0), int, f"cache key {k}")
                                    for k in ("tp_size", "tp_rank")),
                                  *((model["cache_key"].get(k, ""), str, f"cache key {k}")
                                    for k in ("dtype", "quantization", "component")),
                                  (engine["kernels"], str, "kernels"), (model["weight_bytes"], int, "weight bytes"),
                                  (model["content_digest"], str, "content digest"), (manifest["created"], str, "created"),
                                  (manifest["image"]["bytes"], int, "image bytes"),
                                  (manifest["image"]["weight_bytes"], int, "image weight bytes"),
                                  (canary["prompt_ids"], list, "canary prompt ids"),
                                  (manifest["host"].get("cpu_flags", []), list, "host cpu_flags"),
                                  *((manifest["host"].get(k, ""), str, f"host {k}")
                                    for k in ("kernel", "machine", "criu", "python", "torch", "preload"))):
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SnapshotError(f"{path}: {what} is not a {kind.__name__}")
        if not re.fullmatch(r"(cpu|cuda):[0-9]{1,4}", engine["device"]):
            raise SnapshotError(f"{path}: device {engine['device'][:40]!r} is not cpu:N or cuda:N")
        key = model["cache_key"]
        if not (1 <= model["version"] < 2**31 and 1 <= key.get("tp_size", 1) <= 4096
                and 0 <= key.get("tp_rank", 0) < key.get("tp_size", 1)):
            raise SnapshotError(f"{path}: the model's version or TP rank is out of range")
        if not all(isinstance(flag, str) for flag in manifest["host"].get("cpu_flags", [])):
            raise SnapshotError(f"{path}: host cpu_flags is not a list of strings")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise SnapshotError(f"{path} is not a valid snapshot manifest ({type(e).__name__}: {e})") from None
    return manifest


def host_mismatches(manifest: dict, criu: str) -> list[str]:
    """What about this host differs from the snapshot's in ways that can break the restored process."""
    then, now = manifest["host"], host_facts(criu)
    problems = [f"{field}: snapshot {then.get(field)!r}, this host {now[field]!r}"
                for field in ("kernel", "machine", "criu", "preload", "python", "torch") if then.get(field) != now[field]]
    missing = sorted(set(then.get("cpu_flags", [])) - set(now["cpu_flags"]))
    if missing:
        problems.append(f"cpu_flags: this CPU lacks {', '.join(missing)}, which the snapshot's host had")
    return problems


def key_dict(key) -> dict:
    """A pb.CacheKey in CacheKey.to_dict's shape (without importing the torch-side modules)."""
    fields = ("path", "size", "mtime_ns", "inode", "header_sha256", "ctime_ns", "device")
    return {"files": [{f: getattr(file, f) for f in fields} for file in key.files],
            "architecture": key.architecture, "tp_size": key.tp_size, "tp_rank": key.tp_rank, "dtype": key.dtype,
            "quantization": key.quantization, "component": key.component, "format_version": key.format_version,
            "quant_params": [list(p) for p in sorted(key.quant_params.items())], "content_digest": key.content_digest}


def _layout(key: dict):
    """The pb.Layout of a cache key in key_dict's shape."""
    from protos import preload_pb2 as pb
    return pb.Layout(dtype=key.get("dtype", ""), quantization=key.get("quantization", ""),
                     tp_size=key.get("tp_size", 1), tp_rank=key.get("tp_rank", 0), component=key.get("component", ""))


def hold_version(identity: dict, runtime: pathlib.Path):
    """A lease of the engine's version of its own, on a session of this process (the socket, which
    ends it when closed), or None where there is none to take. An engine lets go of its lease at the
    quiet point, and retention could then free its version (a version leased by that engine alone,
    out of --keep), so that it could not attach again after the dump and died."""
    from preload_daemon.session_client import SessionError, open_session, request
    from preload_daemon.sessions import ATTACH, session_path
    from protos import preload_pb2 as pb
    model = identity.get("model") or {}
    key = model.get("cache_key") or {}
    if identity.get("load_format") != "ipc_cache" or not key:
        return None
    layout = _layout(key)
    try:
        sock, _ = open_session(session_path(socket_path(runtime, identity["device"])), 5.0)
    except (SessionError, KeyError):
        return None
    try:
        message = pb.AttachRequest(model=model["name"], version=model["version"], layout=layout)
        request(sock, ATTACH, message.SerializeToString(), 10.0)
    except Exception:  # (not held any more: the engine's own lease is all there is)
        sock.close()
        return None
    return sock


def daemon_problem(manifest: dict, runtime: pathlib.Path) -> str:
    """Why the daemon cannot give the restored engine its weights back ("" when it can): it must
    hold the snapshot's version with the same cache key and digest, and, for an engine that
    followed the active version, that version must still be the active one."""
    from preload_daemon.session_client import REFUSED, SessionAnswerError, SessionError, open_session, request
    from preload_daemon.sessions import ATTACH, session_path
    from protos import preload_pb2 as pb
    engine, model = manifest["engine"], manifest["engine"]["model"]
    key = model["cache_key"]
    layout = _layout(key)
    path = session_path(socket_path(runtime, engine["device"]))
    try:
        sock, _ = open_session(path, 5.0)
    except SessionError as e:
        if e.errno == REFUSED:  # it runs, and said why
            return f"the daemon for {engine['device']} in {runtime} refused a session: {e.strerror}"
        return (f"no daemon answers for {engine['device']} in {runtime} ({e.strerror or e}); start it (`preload serve "
                f"{model['path']}`) so that it holds {model['name']} v{model['version']} again")
    try:
        asked = [model["version"]] + ([0] if model.get("follows_active") else [])
        answers = []
        for version in asked:
            message = pb.AttachRequest(model=model["name"], version=version, layout=layout)
            answers.append(pb.AttachResponse.FromString(request(sock, ATTACH, message.SerializeToString(), 10.0)))
    except SessionAnswerError as e:
        return (f"the daemon no longer holds {model['name']} v{model['version']} as snapshotted ({e}); take a new "
                "snapshot of an engine on the weights it holds now")
    except SessionError as e:
        return f"the daemon on {engine['device']} did not answer: {e.strerror or e}"
    finally:
        sock.close()  # ends the leases these lookups took
    held = key_dict(answers[0].manifest.key)
    if json.loads(json.dumps(held)) != json.loads(json.dumps(key)):
        changed = sorted(k for k in set(held) | set(key) if held.get(k) != key.get(k))
        return (f"the daemon holds other weights for {model['name']} v{model['version']} now (changed: "
                f"{', '.join(changed)}); take a new snapshot")
    if model.get("follows_active") and answers[1].manifest.version != model["version"]:
        return (f"the engine followed the active version of {model['name']}, which is v{answers[1].manifest.version} "
                f"now; the snapshot holds v{model['version']}. Take a new snapshot (or roll back)")
    return ""


def refusal(ready: dict, url: str) -> str:
    """Why this engine cannot be snapshotted ("" when it can)."""
    if ready.get("status") != "ready":
        return f"the engine at {url} is not ready ({ready.get('reason', ready.get('status'))}); try once it is"
    if "dp_size" in ready:  # a data-parallel router: its replicas are processes of their own
        return (f"the engine at {url} is a data-parallel router over {ready['dp_size']} replicas, which cannot be "
                "snapshotted; snapshot a --dp-size 1 engine")
    if int(ready.get("tp_size") or 1) != 1:
        return (f"the engine at {url} runs TP {ready['tp_size']}: only single-device (TP 1) engines can be snapshotted "
                "(a process group's connections between ranks cannot be dumped)")
    if ready.get("load_format") != "ipc_cache":
        return (f"the engine at {url} loaded its weights with {ready.get('load_format')!r}, so they are in its own "
                "memory and would fill the image; start it with --load-format ipc_cache (and a daemon holding the "
                "model) to snapshot it")
    if not isinstance(ready.get("snapshot"), dict) or not isinstance(ready.get("pid"), int):
        return f"the engine at {url} cannot be snapshotted (a DP replica behind a router, or an older preload)"
    if problem := ready["snapshot"].get("problem"):
        return f"the engine at {url} cannot be snapshotted: {problem}"
    if "host_pid" in ready and ready["pid"] != ready["host_pid"]:
        return (f"the engine at {url} was itself restored from a snapshot (it runs in a PID namespace of its own); "
                "restore more copies from that snapshot instead")
    if str(ready.get("device", "cpu")).startswith("cuda") and not shutil.which("cuda-checkpoint"):
        return "the engine runs on a GPU, and NVIDIA's cuda-checkpoint is not on PATH"
    return ""
