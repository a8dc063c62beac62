"""The memory planner's per-kind terms (ringmaster_tools.memory_kinds) against what each module's
autograd graph really saves, and the planner's reading of a model's layers against rm.wire's."""

import jobs_memory_kinds
import pytest
import torch

from ringmaster_tools.memory_kinds import _MODULES, kind_model

KINDS = sorted(set(_MODULES.values()))
CASES = [(kind, mt, ov) for kind in KINDS for mt, ov in kind_model(kind).CASES]
TOL = 0.03


def _check(rows, kind):
    checked = 0
    for r in rows:
        for path, k, measured, predicted, source in r["parts"]:
            if k != "norm" and _MODULES.get(k) != kind:
                continue
            assert predicted == pytest.approx(measured, rel=TOL), (r["S"], path, k, measured, predicted, source)
            checked += 1
    assert checked, f"no {kind} part in the case"


@pytest.mark.parametrize("kind,model_type,overrides", CASES, ids=[f"{k}-{mt}" for k, mt, _ in CASES])
def test_saved_bytes_match_the_graph(kind, model_type, overrides):
    """P=1, fp32 at two lengths and bf16 at one: every part of the kind (and every norm) within 3%."""
    _check(jobs_memory_kinds.measure_saved(model_type, overrides, [128, 256]), kind)
    if getattr(kind_model(kind), "BF16", True):   # mLSTM: transformers' kernel does not run in bf16
        _check(jobs_memory_kinds.measure_saved(model_type, overrides, [128], dtype=torch.bfloat16), kind)


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_saved_bytes_under_cp(pool, backend):
    """P=2: what CP adds per layer (Ulysses' replicated K/V and re-laid output, Ring's fp32 output, the
    recurrent kinds' halos, states and chunk maps) within 3%, for one case of every kind."""
    for kind in KINDS:
        model = kind_model(kind)
        model_type, overrides = model.CASES[0]
        seq = getattr(model, "CP_SEQ", 256)   # chunked kernels: two chunks per kernel call of each rank
        rows = pool.run(jobs_memory_kinds.measure_saved_job, model_type, overrides, [seq], 2, backend)[0]
        _check(rows, kind)


def test_plan_reads_every_hybrid_family_as_wire_does(pool):
    """`ringmaster plan --config` classifies each decoder layer's mixers exactly as rm.wire wires them,
    for every registered family with a recurrent kind (29 families)."""
    families = jobs_memory_kinds.hybrid_families()
    assert len(families) >= 25
    got = {}
    for rank_rows in pool.run(jobs_memory_kinds.wired_and_planned_kinds, families):
        got.update(rank_rows)
    assert sorted(got) == families
    for family, row in got.items():
        assert row["wired"] == row["planned"], (family, row)
        assert any(row["wired"]), family
        assert row["source"].startswith("classified as rm.wire does"), family
