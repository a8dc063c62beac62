"""Features the model zoo needs, exact under Ulysses and Ring or refused with the reason (issue 15).

* chunked attention (llama4 ``chunked_attention`` layers): chunks are fixed-length documents of
  *global* positions, so every backend masks them; the tiny model also crosses llama4's
  ``floor_scale``, so its NoPE layer's query temperature must come from global positions too;
* cross-layer KV sharing (gemma3n ``kv_sharing_modes``): the reusing layers' CP attention gets the
  shard's own K/V, exact with no extra wiring;
* refusals: query slicing / KV cache (fewer queries than keys), an ALiBi bias tensor, and
  Gemma-style bidirectional image spans (``token_type_ids``) in a VLM batch;
* mutations: chunk boundaries or the temperature from local positions -> the model-level check fails.

Every CP case is compared with the same model without CP: loss, gathered logits and every
parameter's gradient against its own norm (``compare``), at P=2 (dp=2 x cp=2) and P=4.
"""

import jobs_features as jf
import pytest
import torch

TOL = 1e-4
DETECT = 1e-2


def _assert_exact(results, backend, n_layers=4):
    for rank, r in enumerate(results):
        assert r["backend"] == backend and r["attention_layers"] == n_layers, (rank, r)
        assert r["n_grads"] == r["n_params"], (rank, r)
        for key in ("loss_err", "logits_err", "grad_err"):
            assert r[key] <= TOL, (rank, key, r)


@pytest.mark.parametrize("P,backend", [(2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring")])
def test_llama4_chunked_attention_exact(pool, P, backend):
    _assert_exact(pool.run(jf.parity, "llama4_text", P, backend), backend)


def test_llama4_chunked_eager_exact(pool):
    """Ulysses with the dense-mask (eager) kernel."""
    _assert_exact(pool.run(jf.parity, "llama4_text", 2, "ulysses", attn_implementation="eager"), "ulysses")


def test_llama4_chunked_ring_allgather_exact(pool):
    """Ring over head_tail shards, the all-gather rotation."""
    _assert_exact(pool.run(jf.parity, "llama4_text", 2, "ring", cfg_kwargs={"rotate_method": "allgather"}), "ring")


def test_llama4_chunked_usp_exact(pool):
    """USP: Ulysses 2 x Ring 2."""
    _assert_exact(pool.run(jf.parity, "llama4_text", 4, "usp", cfg_kwargs={"ulysses_size": 2, "ring_size": 2}), "usp")


def test_llama4_chunked_distflash_refused_at_wire(pool):
    """The distflash schedule balances causal full attention only: a model with chunked layers is
    refused when wired, naming the layers and the load_balance that works."""
    for rank, r in enumerate(pool.run(jf.refusal, "llama4_text", 2, "ring", cfg_kwargs={"load_balance": "distflash"})):
        assert r is not None and r[0] == "ValueError", (rank, r)
        assert "sliding-window/chunked attention layers; use load_balance='none'" in r[1], (rank, r)


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_llama4_chunked_packed_exact(pool, backend):
    """One packed row of documents whose lengths are no multiple of the chunk: chunks restart at
    each document (HF's own forward of the packed row is the reference)."""
    _assert_exact(pool.run(jf.parity, "llama4_text", 2, backend, packed=[17, 23, 8]), backend)


@pytest.mark.parametrize("P,backend", [(2, "ulysses"), (4, "ulysses"), (2, "ring")])
def test_llama4_chunked_flash_exact(pool, P, backend):
    """A flash-named model (the CPU stand-in of the hub kernels): Ulysses' varlen call and Ring's
    hub provider get the chunks as documents."""
    pytest.importorskip("kernels")
    _assert_exact(pool.run(jf.flash_parity, "llama4_text", P, backend), backend)


def test_llama4_chunked_flex_forward_exact(pool):
    """Ulysses over flex_attention: the BlockMask carries the chunk documents (flex has no CPU
    backward, so loss and gathered logits of a forward, against sdpa without CP)."""
    import jobs_flex

    for rank, r in enumerate(pool.run(jobs_flex.flex_forward_parity, 2, "llama4_text", jf.LLAMA4, seq_len=48)):
        assert r["attention_layers"] == 4 and r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r)


@pytest.mark.parametrize("family", ["gemma3n_text", "gemma4_text"])
@pytest.mark.parametrize("P,backend", [(2, "ulysses"), (4, "ring")])
def test_kv_sharing_exact(pool, family, P, backend):
    """Layers 2-3 reuse the K/V layers 0-1 stored (a sliding and a full layer)."""
    _assert_exact(pool.run(jf.parity, family, P, backend), backend)


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_gemma4_logits_to_keep_refused(pool, backend):
    """gemma4 slices its inputs to ``logits_to_keep`` before the KV-shared layers: the shard's
    queries no longer match its keys, refused on every rank before the layer's first collective."""
    for rank, r in enumerate(pool.run(jf.refusal, "gemma4_text", 2, backend, call_kwargs={"logits_to_keep": 1})):
        assert r is not None and r[0] == "NotImplementedError", (rank, r)
        assert "Gemma4TextAttention (layer_idx=2): 1 query tokens against 24 keys" in r[1], (rank, r)


@pytest.mark.parametrize("mutation", ["chunks_from_local_positions", "temperature_from_local_positions"])
@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_local_positions_mutations_are_caught(pool, mutation, backend):
    results = pool.run(jf.mutated_parity, mutation, "llama4_text", 2, backend)
    for rank, r in enumerate(results):
        for key in ("loss_err", "logits_err", "grad_err"):
            assert r["clean"][key] <= TOL, (rank, key, r["clean"])
        mutated = r["mutated"]
        assert "raised" not in mutated, (rank, mutated)
        assert mutated["logits_err"] > DETECT and mutated["grad_err"] > DETECT, (rank, mutated)


def test_query_slicing_refused_before_collectives():
    """Fewer query tokens than keys on a rank (a KV cache, or gemma4's logits_to_keep slicing)."""
    from ringmaster.attention import layer_rules

    class Layer(torch.nn.Module):
        layer_idx = 3

    q, k = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 6, 8)
    with pytest.raises(NotImplementedError, match="2 query tokens against 6 keys.*logits_to_keep=0"):
        layer_rules.apply(Layer(), q, k, None, {})


def test_alibi_bias_refused():
    from ringmaster.attention import layer_rules

    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(NotImplementedError, match="attention bias `alibi`"):
        layer_rules.apply(torch.nn.Linear(1, 1), q, q, None, {"alibi": torch.zeros(4, 6, 6)})


def test_no_backend_dispatching_family_uses_alibi():
    """The finding behind 'alibi: refused': every installed family that builds ALiBi calls its own
    attention (never the attention interface), so rm.wire never reaches it. If a new one
    dispatches, this fails and ALiBi needs handling (a bias from global positions)."""
    import os

    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    dispatching = []
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if os.path.exists(path):
            src = open(path).read()
            if "alibi" in src and "ALL_ATTENTION_FUNCTIONS" in src:
                dispatching.append(family)
    assert dispatching == [], dispatching


def test_bidirectional_spans_refused_at_shard():
    """A VLM batch whose token_type_ids mark image tokens (Gemma3/PaliGemma: image spans attend
    bidirectionally) is refused when it is cut, before any collective."""
    from ringmaster.sharding.batch import shard_collated_batch

    ids = torch.arange(16)[None]
    tt = torch.zeros(1, 16, dtype=torch.long)
    tt[0, 4:8] = 1
    batch = {"input_ids": ids, "labels": ids, "token_type_ids": tt}
    with pytest.raises(NotImplementedError, match="bidirectional.*token_type_ids.*positions 4..7"):
        shard_collated_batch(batch, 0, 2, multimodal=True)
    shard_collated_batch({**batch, "token_type_ids": torch.zeros_like(tt)}, 0, 2, multimodal=True)  # text only: fine
    shard_collated_batch(batch, 0, 2)  # a text model's token_type_ids (segment embeddings) mask nothing


def test_chunk_doc_ids_global_rule():
    """Chunks restart at each document (packed rows) and after left padding, as HF's chunked mask."""
    from ringmaster.sharding.documents import batch_documents, chunk_doc_ids

    assert chunk_doc_ids(None, 7, 3).tolist() == [[0, 0, 0, 1, 1, 1, 2]]
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    docs = batch_documents({"position_ids": pos}, 9)
    assert chunk_doc_ids(docs, 9, 3).tolist() == [[0, 0, 0, 1, 2, 2, 2, 3, 3]]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    docs = batch_documents({"attention_mask": mask}, 6)
    ids = chunk_doc_ids(docs, 6, 3)[0].tolist()
    assert ids[2] == ids[3] == ids[4] != ids[5] and len({ids[0], ids[1], ids[2]}) == 3, ids
