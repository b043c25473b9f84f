"""One rank of a real tensor-parallel group, run by tests/worker/test_parallel.py as N processes:
for each case it loads this rank's shard (cold, and warm from the daemon of cpu:RANK), builds the
model on the group, and rank 0 writes the full logits of a prompt and 12 greedy tokens.

    python -m tests.worker.tp_probe RANK SIZE PORT RUNTIME_DIR OUT_DIR CASES_JSON
"""

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file

from preload_daemon.client import DaemonClient
from preload_daemon.plan import LoadSpec
from worker.loader import LoadRequest, load_ipc_cache, load_safetensors
from worker.model import CausalLM
from worker.parallel import Rendezvous, TPGroup

PROMPT = [5, 17, 99, 3, 200, 41, 7, 8, 150, 2, 33]
NEW_TOKENS = 12


def run_case(model: CausalLM) -> tuple[torch.Tensor, list[int]]:
    cache = model.new_cache(1, 64)
    ids = torch.tensor([PROMPT])
    logits = model.forward(ids, torch.arange(len(PROMPT))[None], cache, torch.tensor([0]), all_logits=True)
    tokens = [int(logits[0, -1].argmax())]
    for step in range(NEW_TOKENS - 1):
        out = model.forward(torch.tensor([[tokens[-1]]]), torch.tensor([[len(PROMPT) + step]]), cache,
                            torch.tensor([0]))
        tokens.append(int(out.argmax(-1)))
    return logits, tokens


def main() -> None:
    rank, size, port = map(int, sys.argv[1:4])
    runtime_dir, out = pathlib.Path(sys.argv[4]), pathlib.Path(sys.argv[5])
    cases = json.loads(sys.argv[6])
    torch.set_num_threads(1)
    group = TPGroup(Rendezvous(rank=rank, size=size, port=port)).join()
    results = {}
    for name, (path, quantization) in cases.items():
        spec = LoadSpec(path=path, quantization=quantization, tp_size=size, tp_rank=rank)
        with DaemonClient.for_device(f"cpu:{rank}", runtime_dir) as client:
            client.load(spec)
        request = LoadRequest(spec=spec, device=f"cpu:{rank}", runtime_dir=runtime_dir, fallback=False)
        for how, loader in (("cold", load_safetensors), ("warm", load_ipc_cache)):
            weights = loader(request)
            assert weights.load_format == ("safetensors" if how == "cold" else "ipc_cache")
            logits, tokens = run_case(CausalLM.from_config(weights.config, weights.tensors, group))
            results[f"{name}/{how}"] = tokens
            if rank == 0:
                save_file({"logits": logits.contiguous()}, str(out / f"{name}-{how}.safetensors"))
            if weights.attached is not None:
                weights.attached.release()
    if rank == 0:
        (out / "tokens.json").write_text(json.dumps(results))
    group.close()


if __name__ == "__main__":
    main()
