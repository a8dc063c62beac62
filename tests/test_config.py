"""RingmasterConfig: string values, aliases, AUTO resolution into a frozen plan, validation messages; the
user's config object is never changed by rm.setup / rm.wire."""

import copy
import dataclasses
import pickle

import pytest

import ringmaster as rm
from ringmaster.config import auto_select


def test_strings_and_enums_are_interchangeable():
    cfg = rm.RingmasterConfig(size=4, backend="ulysses", rotate_method="p2p", load_balance="none",
                              ring_impl="torch_native")
    assert cfg.backend is rm.Backend.ULYSSES
    assert cfg.rotate_method is rm.RotateMethod.ALLTOALL  # "p2p" is an alias
    assert rm.RotateMethod("p2p") is rm.RotateMethod.ALLTOALL
    assert cfg.load_balance is rm.LoadBalance.NONE
    assert cfg.ring_impl is rm.RingImpl.TORCH_NATIVE
    assert rm.Backend("usp") is rm.Backend.USP


def test_axolotl_style_construction_and_normalize():
    """axolotl 0.21's plugin ignores what normalize returns and reads / assigns the config's own fields
    afterwards, then hands the same object to rm.setup: normalize resolves in place for it."""
    cfg = rm.RingmasterConfig(size=8, backend=rm.Backend("auto"), ulysses_size=rm.AUTO, ring_size=rm.AUTO,
                              rotate_method=rm.RotateMethod("allgather"), load_balance=rm.LoadBalance.NONE,
                              ring_impl=rm.RingImpl("auto"))
    assert rm.mesh.intra_node_size() >= 1
    plan = cfg.normalize(num_kv_heads=8, intra_node_size=8)
    assert (cfg.ulysses_size, cfg.ring_size) == (8, 1) and cfg.normalized
    assert cfg.backend is rm.Backend.ULYSSES and cfg.backend.value == "ulysses"
    assert plan.as_dict() == cfg.as_dict() and isinstance(plan, rm.RingmasterPlan)
    cfg.load_balance = rm.LoadBalance("none")  # the plugin assigns after normalize
    assert cfg.load_balance.value == "none"
    assert cfg.resolve().load_balance is rm.LoadBalance.NONE   # what rm.setup(cfg) then runs by


def test_resolve_returns_a_frozen_plan_and_leaves_the_config_alone():
    cfg = rm.RingmasterConfig(size=8, rotate_method="p2p")
    before = copy.deepcopy(cfg)
    plan = cfg.resolve(num_kv_heads=2, intra_node_size=8, num_heads=32)
    assert cfg == before and cfg.as_dict() == before.as_dict() and not cfg.normalized
    assert cfg.ulysses_size is rm.AUTO and cfg.backend is rm.Backend.AUTO
    assert (plan.backend, plan.ulysses_size, plan.ring_size) == (rm.Backend.USP, 2, 4)
    assert plan.load_balance is rm.LoadBalance.NONE and plan.recurrent == "scan" and plan.normalized
    assert plan.resolve(num_kv_heads=8) is plan and plan.normalize() is plan   # already resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.load_balance = rm.LoadBalance.HEAD_TAIL
    # the same field names: `cfg = cfg.normalize(...)` code keeps reading the fields it read before
    assert set(plan.as_dict()) == set(cfg.as_dict())
    assert plan.replace(ulysses_size=1, ring_size=8, load_balance="head_tail").backend is rm.Backend.USP
    with pytest.raises(ValueError, match="!= size"):
        plan.replace(ring_size=2)
    with pytest.raises(ValueError, match="every AUTO resolved"):
        rm.RingmasterPlan(**{**dataclasses.asdict(plan), "load_balance": rm.LoadBalance.AUTO})


def test_fields_assigned_after_construction_are_checked_when_resolved():
    cfg = rm.RingmasterConfig(size=4, backend="ring")
    cfg.load_balance = "none"                     # a string, assigned later
    assert cfg.resolve().load_balance is rm.LoadBalance.NONE
    cfg.load_balance = "zig"
    with pytest.raises(ValueError, match="load_balance='zig' is not one of"):
        cfg.resolve()


@pytest.mark.parametrize("kwargs, match", [
    (dict(size=0), "size=0 must be a positive int"),
    (dict(size=4, backend="ulysess"), "backend='ulysess' is not one of"),
    (dict(size=4, load_balance="zig"), "load_balance='zig' is not one of"),
    (dict(size=4, ulysses_size=0), "ulysses_size=0 must be a positive int"),
    (dict(size=4, recurrent="fast"), "recurrent='fast' is not one of"),
])
def test_invalid_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rm.RingmasterConfig(**kwargs)


def test_split_product_must_match():
    with pytest.raises(ValueError, match=r"ulysses_size\(2\) \* ring_size\(3\) = 6 != size\(4\)"):
        rm.RingmasterConfig(size=4, backend="usp", ulysses_size=2, ring_size=3).normalize(num_kv_heads=8)
    with pytest.raises(ValueError, match="backend='ulysses' needs ulysses_size=size=4"):
        rm.RingmasterConfig(size=4, backend="ulysses", ring_size=2).normalize(num_kv_heads=8)


def test_load_balance_auto_resolves_by_backend():
    assert rm.RingmasterConfig(size=4, backend="ulysses").normalize(8).load_balance is rm.LoadBalance.NONE
    assert rm.RingmasterConfig(size=4, backend="ring").normalize(8).load_balance is rm.LoadBalance.HEAD_TAIL


def test_auto_is_a_picklable_singleton():
    assert pickle.loads(pickle.dumps(rm.AUTO)) is rm.AUTO
    assert repr(rm.AUTO) == "AUTO"


@pytest.mark.parametrize("heads, kv, world, per_node, expected", [
    (32, 8, 8, 8, (8, 1)),     # Ulysses fits heads and node
    (32, 8, 16, 8, (8, 2)),    # Ulysses inside the node, Ring across two nodes
    (32, 2, 8, 8, (2, 4)),     # 2 KV heads cap Ulysses at 2
    (32, 1, 8, 8, (1, 8)),     # MQA: pure Ring
    (12, 4, 8, 8, (4, 2)),
    (None, None, 4, None, (4, 1)),
])
def test_auto_select_table(heads, kv, world, per_node, expected):
    assert auto_select(heads, kv, world, per_node) == expected


def test_compat_gate():
    from ringmaster.compat import require_torch

    require_torch()  # installed torch is new enough
    with pytest.raises(ImportError, match=r"needs torch>=99.0"):
        require_torch((99, 0))


def _wire_and_setup_leave_the_config_alone(ctx):
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    out = {}
    for name, cfg in (("auto", rm.RingmasterConfig(size=2)),
                      ("ring", rm.RingmasterConfig(size=2, backend="ring", recurrent="auto"))):
        before = copy.deepcopy(cfg)
        model = tiny_model("llama")
        runtime = rm.wire(model, cfg, device_mesh=ctx.mesh(2))
        with context_parallel_region(tiny_batch(model.config.vocab_size, 32), runtime=runtime) as shard:
            model(**shard).loss.backward()
        rm.unwire(model)
        out[f"wire-{name}"] = dict(unchanged=cfg == before and cfg.as_dict() == before.as_dict()
                                   and not cfg.normalized, plan=type(runtime.config).__name__,
                                   resolved=runtime.config.as_dict())
        runtime = rm.setup(cfg, num_kv_heads=2, device_mesh=ctx.mesh(2))
        out[f"setup-{name}"] = dict(unchanged=cfg == before and not cfg.normalized,
                                    plan=type(runtime.config).__name__, resolved=runtime.config.as_dict())
        rm.teardown()
    return out


def test_wire_and_setup_never_change_the_users_config(pool):
    for result in pool.run(_wire_and_setup_leave_the_config_alone):
        for case, r in result.items():
            assert r["unchanged"] and r["plan"] == "RingmasterPlan", (case, r)
            assert "auto" not in (r["resolved"]["backend"], r["resolved"]["load_balance"], r["resolved"]["recurrent"])
        assert result["wire-ring"]["resolved"]["load_balance"] == "head_tail"
        assert result["wire-auto"]["resolved"]["backend"] == "ulysses"
