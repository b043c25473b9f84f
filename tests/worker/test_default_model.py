"""The embedded default model (SmolLM2-135M-Instruct) against transformers on the same checkpoint."""

import json

import pytest
import torch
import transformers

from preload_daemon.plan import LoadSpec
from worker.engine import Engine
from worker.loader import LoadRequest, load_safetensors
from worker.model import CausalLM
from worker.requests import SamplingParams
from worker.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def reference(default_model):
    return transformers.AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(default_model):
    return transformers.AutoTokenizer.from_pretrained(default_model)


def test_checkpoint_is_bf16_with_tied_embeddings_stored_once(default_model):
    config = json.loads((default_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(default_model))))
    assert "lm_head.weight" not in weights.tensors
    assert {t.dtype for t in weights.tensors.values()} == {torch.bfloat16}


def test_tokenizer_matches_transformers(default_model, hf_tokenizer):
    ours = Tokenizer(default_model)
    for text in PROMPTS + ["Ünïcödé — emoji 🚀 and\nnewlines"]:
        assert ours.encode(text) == hf_tokenizer(text).input_ids
        assert ours.decode(ours.encode(text)) == hf_tokenizer.decode(hf_tokenizer(text).input_ids,
                                                                     skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.chat_prompt(messages) == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)


def test_greedy_continuations_match_transformers(default_model, reference, hf_tokenizer):
    weights = load_safetensors(LoadRequest(spec=LoadSpec(path=str(default_model))))
    engine = Engine(CausalLM.from_config(weights.config, weights.tensors), max_batch=2, max_len=256).start()
    try:
        for prompt in PROMPTS:
            ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
            expected = reference.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
            ours = engine.generate(ids[0].tolist(), SamplingParams(max_tokens=16)).tokens
            eos = engine.model.spec.eos_token_ids
            # transformers ends with the eos token it emitted; we end before it (an eos is not text).
            if any(t in eos for t in expected):
                expected = expected[:min(expected.index(t) for t in eos if t in expected)]
            assert ours == expected, prompt
    finally:
        engine.stop()
