"""llama.cpp's decode rate for `preload bench decode`, timed in a child process of its own, in
turns with the benchmark's rows. In the benchmark's process, beside the engine's threads, llama.cpp
ran at 60% of its speed alone (2-core Zen 4: 100 -> 60 tokens/s, back to 100 once the engine
stopped): its OpenMP runtime and torch's then hold more threads than there are cores, and waits
that spin when alone sleep instead. The child is told the prompt, the weight bits and the threads,
answers `{"ready": true, "name": ...}` (or false, and why), and then one decode's tokens/s for
each line it reads.

    python -m preload_cli.bench.llama_cpp SETTINGS_JSON
"""

import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import time

LLAMA_FTYPES = {"none": ("BF16", 32), "int8": ("Q8_0", 7)}  # llama.cpp's file types with the same weight bits
ANSWER_TIMEOUT_S = 600.0


class LlamaCpp:
    """The child: `run()` times one decode (None once it fails); `name` says what it runs, or why it
    does not (then `available` is False)."""

    def __init__(self, ids: list[int], quantization: str, new_tokens: int, threads: int, gguf: str | None,
                 model: str | None):
        settings = {"ids": ids, "quantization": quantization, "new_tokens": new_tokens, "threads": threads,
                    "gguf": gguf, "model": model}
        self.log = tempfile.TemporaryFile("w+", errors="replace")  # what it says (llama.cpp's lines): why it failed
        self.proc = subprocess.Popen([sys.executable, "-m", "preload_cli.bench.llama_cpp", json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.available, self.name = True, ""
        answer = self._answer()
        if answer is not None:
            self.available, self.name = answer["ready"], answer["name"]
        if not self.available:
            self.close()

    def run(self) -> float | None:
        if not self.available:
            return None
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: _answer says how
        answer = self._answer()
        return None if answer is None else answer["tokens_per_s"]

    def _answer(self) -> dict | None:
        """Its next line; None when there is none (it failed: then not `available`, `name` says why)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            answer = {"error": f"it ended, or did not answer within {ANSWER_TIMEOUT_S:g} s, or not in JSON"}
        if "error" not in answer:
            return answer
        self.log.seek(0)
        said = " ".join(self.log.read().split()[-40:])
        self.available, self.name = False, f"failed: {answer['error']}" + (f" ({said})" if said else "")
        self.close()
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        try:
            self.proc.stdin.close()  # after a broken pipe: its buffered line is dropped, not reported at exit
        except OSError:
            pass
        self.log.close()


def _runner(settings: dict, tmp: str):
    """(a function timing one decode, in tokens/s, greedy, and its row's name; or None, and why not)."""
    try:
        import llama_cpp
    except ImportError:
        return None, ("skipped: llama_cpp is not importable; `pip install llama-cpp-python` to compare (and pass "
                      "--gguf FILE for a model other than the default)")
    if settings["quantization"] not in LLAMA_FTYPES:
        return None, f"skipped: llama.cpp has no file type with {settings['quantization']}'s weight bits"
    name, ftype = LLAMA_FTYPES[settings["quantization"]]
    if settings["gguf"]:
        gguf = settings["gguf"]
    elif settings["model"]:
        return None, "skipped: pass --gguf FILE (this model as GGUF) to compare against llama.cpp"
    else:  # the default model's own GGUF, re-quantized to the weight bits our engine runs
        from preload_daemon.default_model import gguf_path

        gguf = str(pathlib.Path(tmp) / f"model-{name}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = ftype, True
        if llama_cpp.llama_model_quantize(str(gguf_path()).encode(), gguf.encode(), params) != 0:
            return None, f"failed: llama.cpp could not write a {name} GGUF"
    ids, new_tokens, threads = settings["ids"], settings["new_tokens"], settings["threads"]
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(ids) + new_tokens + 8, n_threads=threads, verbose=False)

    def run() -> float:  # decode steps per second after the prompt's evaluation, as for the engine's rows
        llm.reset()
        llm.eval(ids)
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([llm.sample(temp=0.0)])
        return new_tokens / (time.perf_counter() - start)

    return run, f"llama.cpp {name}, {threads} threads"


def main() -> int:
    settings = json.loads(sys.argv[1])
    answers = os.fdopen(os.dup(1), "w")  # the protocol's lines; whatever else writes to stdout goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run, name = _runner(settings, tmp)
        except Exception as e:  # an optional comparison: llama-cpp-python's API moves between releases
            run, name = None, f"failed: {type(e).__name__}: {e}"
        print(json.dumps({"ready": run is not None, "name": name}), file=answers, flush=True)
        if run is None:
            return 0
        for _ in sys.stdin:
            try:
                print(json.dumps({"tokens_per_s": run()}), file=answers, flush=True)
            except Exception as e:
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}), file=answers, flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
