"""MTP draft components in the daemon: their own slab and key in the same version, the embedding and
lm_head shared with the main component by reference (one copy), TP sharding from the arch spec."""

import pytest
import torch
from safetensors.torch import load_file

from preload_cli.models import tiny_model
from preload_daemon.checkpoint import Checkpoint
from preload_daemon.errors import PlanError
from preload_daemon.plan import Layout, LoadSpec, build_plan


@pytest.fixture(scope="module")
def mtp_llama(tmp_path_factory):
    """A tiny Llama with one MTP layer that stores copies of the embedding and lm_head (DeepSeek-V3 style)."""
    return tiny_model("llama", tmp_path_factory.mktemp("mtp") / "mtp-llama", mtp_layers=1, mtp_shared=True)


def test_the_draft_plan_holds_the_mtp_layer_and_no_copy_of_embedding_or_head(mtp_llama):
    checkpoint = Checkpoint(mtp_llama)
    main = build_plan(checkpoint, LoadSpec(path=str(mtp_llama)))
    draft = build_plan(checkpoint, LoadSpec(path=str(mtp_llama), component="draft"))
    stored = load_file(str(mtp_llama / "model.safetensors"))
    mtp = {n for n in stored if n.startswith("model.layers.2.")}
    assert {e.name for e in draft.entries} == mtp - {"model.layers.2.embed_tokens.weight",
                                                      "model.layers.2.shared_head.head.weight"}
    assert not {e.name for e in main.entries} & mtp
    rank1 = build_plan(checkpoint, LoadSpec(path=str(mtp_llama), component="draft", tp_size=2, tp_rank=1))
    shapes = {e.name: e.shape for e in rank1.entries}
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (32, 64), "the draft layer shards like the main ones"
    assert shapes["model.layers.2.eh_proj.weight"] == (64, 128), "eh_proj is replicated"


def test_draft_and_main_share_one_copy_of_embedding_and_lm_head(daemon, mtp_llama):
    main, draft = daemon.client.load_all(LoadSpec(path=str(mtp_llama), name="m"),
                                         layouts=(Layout(component="draft"),))
    assert (main.version, draft.version) == (1, 1) and draft.key.component == "draft"
    assert draft.key.content_digest != main.key.content_digest
    stats = daemon.client.stats()
    assert stats.resident_bytes == main.slab_bytes + draft.slab_bytes
    stored = load_file(str(mtp_llama / "model.safetensors"))
    embed_bytes = stored["model.embed_tokens.weight"].nbytes
    layer_bytes = sum(t.nbytes for n, t in stored.items() if n.startswith("model.layers.2.")) - 2 * embed_bytes
    assert layer_bytes <= draft.slab_bytes < layer_bytes + 64 * 1024, "the draft slab holds only the MTP layer"

    attached = daemon.client.attach("m", layout=Layout(component="draft"))
    slabs = {s.id: s for s in attached.manifest.slabs}
    assert len(slabs) == 2
    by_name = {t.name: t for t in attached.manifest.tensors}
    main_slab = next(s for s in attached.manifest.slabs if s.size == main.slab_bytes)
    assert by_name["model.embed_tokens.weight"].slab == main_slab.id
    assert by_name["lm_head.weight"].slab == main_slab.id
    assert by_name["model.layers.2.eh_proj.weight"].slab != main_slab.id
    assert torch.equal(attached["model.embed_tokens.weight"], stored["model.embed_tokens.weight"])
    assert torch.equal(attached["model.layers.2.eh_proj.weight"], stored["model.layers.2.eh_proj.weight"])
    main_view = daemon.client.attach("m")
    assert [s.path for s in main_view.manifest.slabs] == [main_slab.path], "one file holds the shared tensors"
    assert not any(t.name.startswith("model.layers.2.") for t in main_view.manifest.tensors)


def test_a_draft_needs_its_main_component(daemon, mtp_llama, tiny_llama):
    with pytest.raises(PlanError, match="shares the main component's embedding and lm_head"):
        daemon.client.load(LoadSpec(path=str(mtp_llama), name="m", component="draft"))
    daemon.client.load(LoadSpec(path=str(mtp_llama), name="m"))
    with pytest.raises(PlanError, match="shares the main component"):
        daemon.client.load(LoadSpec(path=str(mtp_llama), name="m", component="draft", dtype="bfloat16"))
    daemon.client.load(LoadSpec(path=str(mtp_llama), name="m", component="draft"))  # now it has one
    with pytest.raises(PlanError, match="no MTP layers"):
        daemon.client.load(LoadSpec(path=str(tiny_llama), component="draft"))
    assert [s.active_version for s in daemon.client.summaries() if s.name == "m"] == [1]
