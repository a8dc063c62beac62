"""RingmasterConfig: string values, aliases, AUTO resolution, validation messages."""

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
    cfg = rm.RingmasterConfig(size=8, backend=rm.Backend("auto"), ulysses_size=rm.AUTO, ring_size=rm.AUTO,
                              rotate_method=rm.RotateMethod("allgather"), load_balance=rm.LoadBalance.NONE,
                              ring_impl=rm.RingImpl("auto"))
    assert rm.mesh.intra_node_size() >= 1
    cfg.normalize(num_kv_heads=8, intra_node_size=8)
    assert (cfg.ulysses_size, cfg.ring_size) == (8, 1)
    assert cfg.backend is rm.Backend.ULYSSES and cfg.backend.value == "ulysses"
    cfg.load_balance = rm.LoadBalance("none")  # the plugin assigns after normalize
    assert cfg.load_balance.value == "none"


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
