"""``recurrent="heads"``: head-parallel recurrent layers against the same model without CP.

Every recurrent family of transformers, float64 end to end (every parameter against its own norm, 1e-5; loss and
gathered logits 1e-10), over P=2 and 4, Ulysses, Ring (``head_tail`` too) and USP around it, dense rows, packed rows
(against every document run alone) and ``load_balance="documents"``. The kernel runs whole rows for H/P heads, so
nothing is passed between ranks: a head split, group replication or sequence order that is wrong shows at once, and
the mutations below make these checks fail.
"""

import jobs_heads as jh
import jobs_recurrent_variants as jv
import pytest
from test_hybrid_parity import FP64_PARAM_TOL, FP64_TOL

# every family whose recurrent layers ringmaster wires (Inkling's short convs keep the halo under every strategy:
# tests/test_relbias.py and tests/test_inkling2.py)
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lara_mini", "olmo_hybrid", "bailing_hybrid",
            "kimi_linear", "nemotron_h", "mamba2", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "minimax",
            "recurrent_gemma", "rwkv", "xlstm", "mamba", "falcon_mamba", "jamba", "zamba", "lfm2", "lfm2_moe", "lfm3"]
# every family at P=2 with Ulysses around it, every mixer at P=4 with Ring's head_tail; P=4 Ulysses and P=2 Ring
# (contiguous) once per kind in the packed and documents grids below
# (P=4 once per mixer: a family whose mixer is another's class unchanged, with the same tiny head counts, runs at P=2
# only; its P=4 twin: qwen3_5_moe_text's Qwen3_5MoeGatedDeltaNet is Qwen3_5GatedDeltaNet (``pass``), lfm2_moe's
# Lfm2MoeShortConv is Lfm2ShortConv, granitemoehybrid's mamba layer is BambaMixer with its own __init__ only)
SAME_MIXER_AT_P4 = {"qwen3_5_moe_text": "qwen3_5_text", "lfm2_moe": "lfm2", "granitemoehybrid": "bamba"}
DENSE = [(m, 2, "ulysses", "auto") for m in FAMILIES] + \
    [(m, 4, "ring", "head_tail") for m in FAMILIES if m not in SAME_MIXER_AT_P4]
# families with parameters a model never uses (zamba2's unused shared-block copies, as without heads)
UNUSED = {"zamba2"}
# one family per kind: packed rows and documents batches
PACKED = [("qwen3_5_text", 4, "ring", "head_tail"), ("kimi_linear", 4, "usp", "auto"), ("nemotron_h", 4, "ulysses", "auto"),
          ("minimax", 2, "ring", "head_tail"), ("mamba", 4, "ulysses", "auto"), ("recurrent_gemma", 2, "ulysses", "auto"),
          ("rwkv", 4, "ring", "head_tail"), ("xlstm", 2, "ring", "auto"), ("lfm2", 2, "ulysses", "auto")]
DOCUMENTS = [("qwen3_5_text", 4, "ring"), ("kimi_linear", 2, "ulysses"), ("nemotron_h", 2, "ring"),
             ("minimax", 4, "ulysses"), ("mamba", 2, "ulysses"), ("recurrent_gemma", 4, "ring"), ("rwkv", 2, "ring"),
             ("xlstm", 4, "ulysses")]


def check(results, P, model_type):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1, r
        assert not r["missing_grads"], r["missing_grads"]
        assert model_type in UNUSED or r["n_grads"] == r["n_params"], (r["n_grads"], r["n_params"])
        assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > FP64_PARAM_TOL}
        assert not worst, (rank, worst)


@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}{'-ht' if c[3] == 'head_tail' else ''}")
def test_dense_rows_fp64(pool, case):
    model_type, P, backend, load_balance = case
    results = pool.run(jh.parity, model_type, P, backend, load_balance=load_balance)
    assert all(r["layout"] == "head_tail" for r in results) or load_balance != "head_tail", [r["layout"] for r in results]
    check(results, P, model_type)


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}{'-ht' if c[3] == 'head_tail' else ''}")
def test_packed_rows_fp64(pool, case):
    model_type, P, backend, load_balance = case
    check(pool.run(jh.parity, model_type, P, backend, rows="packed", load_balance=load_balance), P, model_type)


@pytest.mark.parametrize("case", DOCUMENTS, ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}")
def test_documents_fp64(pool, case):
    model_type, P, backend = case
    check(pool.run(jh.parity, model_type, P, backend, rows="documents"), P, model_type)


MUTATIONS = [
    # mutation, (model, P, backend), job kwargs, parameter that must show it
    ("wrong_head_slice", ("nemotron_h", 2, "ulysses"), {}, "mixer.A_log"),
    ("wrong_head_slice", ("minimax", 2, "ulysses"), {}, "qkv_proj.weight"),
    ("wrong_head_slice", ("rwkv", 2, "ulysses"), {}, "attention.time_decay"),
    ("wrong_head_slice", ("mamba", 2, "ulysses"), {}, "mixer.A_log"),
    ("groups_not_replicated", ("nemotron_h", 4, "ulysses"), {}, "mixer.A_log"),
    ("groups_not_replicated", ("qwen3_5_text", 4, "ulysses"), {}, "linear_attn.in_proj_qkv.weight"),
    ("order_ignored", ("lara_mini", 2, "ring"), {"load_balance": "head_tail"}, "linear_attn.A_log"),
]


@pytest.mark.parametrize("case", MUTATIONS, ids=[f"{c[0]}-{c[1][0]}-P{c[1][1]}" for c in MUTATIONS])
def test_mutations_are_caught(pool, case):
    mutation, args, kwargs, param = case
    for rank, r in enumerate(pool.run(jh.parity, *args, mutation=mutation, **kwargs)):
        errs = {k: v for k, v in r["grad_errs"].items() if param in k}
        assert errs, (param, sorted(r["grad_errs"]))
        print(f"{mutation} {args} rank {rank}: {param} {max(errs.values()):.2e}, loss {r['loss_err']:.1e}")
        assert max(errs.values()) > 1e-3, (mutation, rank, errs)


def test_conv_halo_is_kept_and_checked(pool):
    """The layers' short convs keep their halo under heads: dropping it is caught at model level."""
    for out in pool.run(jv.mutated, "conv_halo_dropped", "parity", "lfm3", 2, "heads", "ulysses"):
        assert "raised" not in out, out["raised"]
        errs = {k: v for k, v in out["mutated"]["grad_errs"].items() if "conv.conv.weight" in k}
        assert errs and max(errs.values()) > 1e-3, errs


def test_head_count_the_cp_size_does_not_divide_is_refused_at_wire(pool):
    """Six value heads over four ranks: refused by ``rm.wire``'s probe, naming the counts and the sizes that work."""
    for out in pool.run(jh.refused, "qwen3_5_text", 4, linear_num_value_heads=6):
        assert out is not None, "wired"
        name, msg = out
        assert name == "UnsupportedLayerError", out
        assert "6 heads" in msg and "4 CP ranks" in msg and "[2, 3, 6]" in msg and "recurrent='scan'" in msg, msg


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "mamba"])
def test_gradient_checkpointing(pool, model_type):
    """Decoder layers recomputed in backward (HF gradient checkpointing, fp32): the recomputation runs the two
    all-to-alls again from the step context it replays, and the gradients stay exact."""
    import jobs_mamba1 as jm
    from test_hybrid_parity import PARAM_TOL, TOL, TOTAL_TOL

    for r in pool.run(jm.family_parity, model_type, 2, "heads", checkpointing=True):
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err_total"] <= TOTAL_TOL, r
        assert max(r["grad_errs"].values()) <= PARAM_TOL, r["worst_param"]


AUTO = [("qwen3_5_text", 4, {}), ("nemotron_h", 2, {})]


@pytest.mark.parametrize("model_type, P, overrides", AUTO, ids=[f"{m}-P{P}" for m, P, _ in AUTO])
def test_auto_picks_heads_per_layer_where_it_sends_no_more(pool, model_type, P, overrides):
    """``recurrent="auto"``, per layer and row length: heads on the rows where it sends no more than the state
    passing (scan at P=4, sequential at P=2), the state passing on longer ones; the bytes measured under ``auto`` are
    the smaller of the two on both sides of the length ``rm.wire`` reports."""
    r = pool.run(jh.auto_bytes, model_type, P, (16, 512), **overrides)[0]
    fallback = "sequential" if P <= 2 else "scan"
    longest = {int(c.split("up to ")[1].split()[0]) for c in r["choice"].values()}
    assert len(longest) == 1 and 16 <= min(longest) < 512, r["choice"]
    print(model_type, P, r)
    assert r[("auto", 16)] == r[("heads", 16)] < r[(fallback, 16)], r
    assert r[("auto", 512)] == r[(fallback, 512)] < r[("heads", 512)], r


def test_auto_keeps_the_state_passing_where_heads_do_not_split(pool):
    """Six value heads over four ranks: ``recurrent="heads"`` is refused, ``auto`` keeps the scan and says why."""
    r = pool.run(jh.auto_bytes, "qwen3_5_text", 4, (16,), linear_num_value_heads=6, linear_num_key_heads=2)[0]
    assert "4 does not divide 6" in r["heads"], r
    assert all(c.startswith("scan (") and "6 heads" in c for c in r["choice"].values()), r["choice"]
    assert r[("auto", 16)] == r[("scan", 16)], r


def test_auto_reaches_layers_wired_after_setup(pool):
    """``rm.setup(RingmasterConfig(recurrent="auto"))`` then ``rm.wire_recurrent_layers(model)``: the layers pick per
    layer as under ``rm.wire``; a config that asked ``"scan"`` keeps the scan."""
    auto = pool.run(jh.setup_path_choices, 4)[0]
    assert auto and all(c.startswith("heads on rows up to") for c in auto.values()), auto
    assert pool.run(jh.setup_path_choices, 4, "scan")[0] == {}


def test_auto_choice_compiles_once_per_choice_not_per_length(pool):
    """A compiled block reads ``auto``'s choice as the batch's host bool (``CPBatch.heads_rows``), not the row length:
    five short lengths and two long ones, two graphs (heads, the state passing). Mutation: the length compared in the
    graph, a guard on it (dynamo compiles the first length static, then a graph with the length symbolic: 3)."""
    r = pool.run(jh.auto_choice_graphs)[0]
    assert r["picked"] == [2.0] * 5 + [1.0] * 2 and r["graphs"] == 2, r
    m = pool.run(jh.auto_choice_graphs, mutated=True)[0]
    assert m["picked"] == r["picked"] and m["graphs"] > r["graphs"], m


def test_auto_mutation_inverted_choice_is_caught(pool):
    """The mutation: ``auto`` picking the strategy that sends more; the byte check above fails."""
    r = pool.run(jh.auto_bytes, "qwen3_5_text", 4, (16, 512), inverted=True)[0]
    assert r[("auto", 16)] == r[("scan", 16)] > r[("heads", 16)], r
    assert r[("auto", 512)] == r[("heads", 512)] > r[("scan", 512)], r


COST_FAMILIES = ["qwen3_5_text", "kimi_linear", "nemotron_h", "mamba", "minimax", "recurrent_gemma", "rwkv", "xlstm"]


@pytest.mark.parametrize("model_type", COST_FAMILIES)
def test_costs_agree_wired_planned_and_computed(pool, model_type):
    """One family per kind: what ``auto`` weighs is the same recorded by ``rm.wire``'s probe, by ``layer_costs`` on
    the real model and on the meta device (the planner's); each kind's ``map_meta()`` is the shape of the map its
    ``local_map()`` computes."""
    r = pool.run(jh.costs_checked, model_type, 4)[0]
    assert r["maps"] and all(meta == real for _, meta, real in r["maps"]), r["maps"]
    assert r["wired"] and r["wired"] == r["real"] == r["meta"], r


def test_planner_bytes_match_the_benchmarks_analytic_counts():
    """``ringmaster plan --config``'s recurrent section (``layer_costs`` on the meta model, bf16) against
    ``benchmarks/recurrent_modes.py``'s closed form for Qwen3-Next-80B's gated DeltaNet at P=8, S=32768."""
    import os
    import sys

    from ringmaster_tools.memory_plan import ModelShape, PlanOptions, recurrent_choice
    from transformers import AutoConfig

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from recurrent_modes import heads_per_token
    from state_passing import MODELS, _state_bytes

    m = MODELS["Qwen3-Next-80B (GDN)"]
    config = AutoConfig.for_model("qwen3_5_text", linear_num_key_heads=m["hk"], linear_num_value_heads=m["hv"],
                                  linear_key_head_dim=m["dk"], linear_value_head_dim=m["dv"], num_hidden_layers=4)
    lines = recurrent_choice(ModelShape.from_config(config), PlanOptions(seq=32768, gpus=8, dtype="bf16"))
    fin, fout = heads_per_token(m, 8)
    heads, scan = 32768 // 8 * (fin + fout) * 7 // 8, 7 * _state_bytes(m)[1]
    text = "\n".join(lines)
    assert f"heads {heads / 2**20:.1f} MiB" in text and f"scan {scan / 2**20:.1f} MiB" in text, (text, heads, scan)


AUTO_PARITY = [("qwen3_5_text", 4, 32, {}), ("nemotron_h", 2, 16, {}),
               # six value heads over four ranks: heads cannot split them, auto keeps the scan (no refusal)
               ("qwen3_5_text", 4, 32, {"linear_num_value_heads": 6, "linear_num_key_heads": 2})]


@pytest.mark.parametrize("model_type, P, seq_len, overrides", AUTO_PARITY,
                         ids=[f"{m}-P{P}-S{S}{'-indivisible' if o else ''}" for m, P, S, o in AUTO_PARITY])
def test_auto_is_exact_fp64(pool, model_type, P, seq_len, overrides):
    """``auto`` on rows short enough for heads (and on a layer whose heads do not split: the scan), fp64."""
    check(pool.run(jh.parity, model_type, P, "ulysses", recurrent="auto", seq_len=seq_len, **overrides), P, model_type)


PADDED = [("lara_mini", 2, "ulysses"), ("nemotron_h", 4, "ulysses")]


@pytest.mark.parametrize("model_type, P, backend", PADDED, ids=[f"{m}-P{P}" for m, P, _ in PADDED])
def test_padded_rows_fp64(pool, model_type, P, backend):
    """Two rows, one left- and right-padded: a run of padding is one document of the whole row, so no state reaches
    the first real token (fp64 per parameter)."""
    for rank, r in enumerate(pool.run(jv.padded_parity, model_type, P, "heads", backend)):
        assert not r["nan"] and r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r)
        assert r["grad_err"] <= FP64_PARAM_TOL, (rank, r)


def test_padded_rows_stabilised_state(pool):
    """RWKV's stabilised state under Ring's head_tail, padded rows (fp32: the loss, logits and whole gradient)."""
    import jobs_linear_recurrent as jl
    from test_hybrid_parity import TOL, TOTAL_TOL

    for r in pool.run(jl.padded_parity, "rwkv", 4, "heads", "ring"):
        assert not r["nan"] and r["loss_err"] <= TOL and r["logits_err"] <= TOL, r
        assert r["grad_err_total"] <= TOTAL_TOL, r


def test_rows_cu_seqlens_flattens_every_rows_documents():
    """The varlen boundaries of whole rows flattened into one (FLA's varlen call): each row's document starts shifted
    to where the row starts; one row of runs stands for every row."""
    from ringmaster.sharding.documents import Runs, rows_cu_seqlens

    two = Runs(8, ((0, 3), (0, 5, 6)))
    assert rows_cu_seqlens(two, 2, 8).tolist() == [0, 3, 8, 13, 14, 16]
    one = Runs(8, ((0, 2),))
    assert rows_cu_seqlens(one, 3, 8).tolist() == [0, 2, 8, 10, 16, 18, 24]


def test_groups_the_cp_size_cannot_split_or_replicate_are_refused_at_wire(pool):
    """Mamba2 with three B/C groups over two ranks (six heads: the heads split, the groups neither split nor
    replicate): refused by ``rm.wire``, naming the groups and the sizes that work."""
    for out in pool.run(jh.refused, "nemotron_h", 2, mamba_num_heads=6, n_groups=3):
        assert out is not None, "wired"
        name, msg = out
        assert name == "UnsupportedLayerError" and "3 B/C groups" in msg and "[3, 6]" in msg, msg
