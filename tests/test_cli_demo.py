"""``ringmaster demo``: every family its help lists is accepted and prints "parity OK", and it accepts no
family its help does not list (issue 39: ``demo --model qwen3_next`` printed "parity FAILED" in float32, and the
help listed six attention families while hybrids were accepted).

The full grid (30 families x ulysses / ring / usp / auto at P=2 and P=4) was run once by hand (docs/api.md); here one
hybrid runs through the demo's own code path in the session pool at P=2, the rest are checked by what decides them:
the family list, the precision rule and the head defaults."""

from __future__ import annotations

import argparse
import types

import pytest

from ringmaster import cli
from ringmaster_tools.parity import DEMO_ATTENTION, TINY, demo_families


def _demo_help() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices["demo"].format_help().split())


def _listed() -> list[str]:
    return [f for group in demo_families().values() for f in group]


def test_help_lists_every_accepted_family_and_the_hybrids():
    text = _demo_help()
    for family in _listed():
        assert family in text, family
    for hybrid in ("qwen3_next", "qwen3_5_text", "nemotron_h", "falcon_h1", "mamba2", "jamba"):
        assert hybrid in text, hybrid
    assert "float64" in text        # --dtype says which precision the hybrids run in
    # every listed family is accepted, and every family with a tiny config is listed
    assert set(_listed()) == set(TINY)
    for family in _listed():
        cli._demo_family(family)


def test_unlisted_family_is_refused_with_the_check_command():
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--model", "phi3"])    # a transformers family the demo has no tiny config for
    text = str(exc.value)
    assert "not one of the demo's families" in text and "ringmaster check phi3" in text, text


def test_hybrids_run_in_float64_attention_in_float32():
    """The help's grouping agrees with the registry: exactly the families with recurrent layers run in float64."""
    import ringmaster.architectures  # noqa: F401
    from ringmaster.architectures.spec import registered_architecture

    for family in _listed():
        spec = registered_architecture(types.SimpleNamespace(model_type=family))
        recurrent = bool(spec is not None and spec.recurrent_classes)
        assert recurrent == (family not in DEMO_ATTENTION), family
        assert cli._demo_precision(family, "auto") == ("float64" if recurrent else "float32"), family
    assert cli._demo_precision("qwen3_next", "float32") == "float32"


def test_head_defaults():
    ns = argparse.Namespace
    assert cli._demo_heads(ns(model="llama", heads=None, kv_heads=None)) == dict(num_attention_heads=8,
                                                                                  num_key_value_heads=4)
    # Zamba2's attention width is tied to its adapters: 8 heads would not build; the tiny config's 4 / 4 do
    assert cli._demo_heads(ns(model="zamba2", heads=None, kv_heads=None)) == dict(num_attention_heads=4,
                                                                                   num_key_value_heads=4)
    assert cli._demo_heads(ns(model="mamba2", heads=None, kv_heads=None)) == {}
    assert cli._demo_heads(ns(model="qwen3_next", heads=8, kv_heads=None))["num_attention_heads"] == 8


def test_hybrid_demo_prints_parity_ok(pool, capsys):
    """The demo's own path (flags, precision, job, report) on qwen3_next under Ring at P=2: float64 and OK. In
    float32 its A_log / dt_bias gradients miss 1e-4 by rounding alone (issue 39)."""
    args = cli.build_parser().parse_args(["demo", "--model", "qwen3_next", "--world", "2", "--seq", "64",
                                          "--backend", "ring"])
    args.attn = "sdpa"
    rc = cli.demo(args, pool=pool)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity OK (float64, tolerance 1e-06" in out, out
    assert "qwen3_next" in out and "float64" in out.splitlines()[0], out
