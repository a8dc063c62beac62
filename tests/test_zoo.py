"""The transformers model zoo: every causal-LM family of the installed transformers, shrunk to a
tiny random config, is exact under CP or refused with a reason; never wrong, never a hang.

One sweep (ringmaster_tools/zoo.py) in the session pool, shared by the tests of this module;
the committed coverage table in docs/models.md (tools/zoo_table.py) is the expected result, so a
family that the table says is exact and is not any more fails here, and so does a new family or
a changed verdict (regenerate the table and review the diff).
"""

import os
import sys

import pytest

from ringmaster_tools import zoo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import zoo_table  # noqa: E402

# the suite runs each family once, at P=2, alternating backends (families in order: Ulysses, Ring, Ulysses, ...):
# two cases of every family cost CI's two cores 150 s. The full sweep that writes docs/models.md
# (tools/zoo_table.py) runs all four cases of every family; the P=4 paths and both backends are covered per
# mechanism in the parity tests (test_ring_parity, test_hybrid_parity, test_packing, ...)
SUITE_CASES = (("ulysses", 2), ("ring", 2))


def suite_case(family: str, families: list[str]) -> tuple[str, int]:
    return SUITE_CASES[sorted(families).index(family) % len(SUITE_CASES)]


@pytest.fixture(scope="module")
def swept(pool):
    families = zoo.causal_lm_families()
    rows, seconds = {}, 0.0
    for case in SUITE_CASES:
        part = zoo.sweep(pool, [f for f in families if suite_case(f, families) == case], cases=(case,))
        rows.update(part.rows)
        seconds += part.seconds
    return zoo.SweepResult(rows, seconds)


def _keys(rows):
    """family -> the one case the suite ran for it."""
    families = sorted(rows)
    return {f: "{}{}".format(*suite_case(f, families)) for f in families}


def _suite(table, keys):
    return {f: ({k: v for k, v in row.items() if k == keys.get(f)} if "excluded" not in row else row)
            for f, row in table.items()}


def _cases(rows):
    keys = _keys(rows)
    for family, row in sorted(rows.items()):
        if row["status"] == "scored" and keys[family] in row:
            yield family, keys[family], row[keys[family]]


def test_never_wrong_never_a_hang(swept):
    """Exact or a clean refusal: a crash inside the model (not a refusal ringmaster raised) counts as bad too."""
    bad = [(f, k, c["verdict"], c["reason"]) for f, k, c in _cases(swept.rows)
           if c["verdict"] in ("WRONG", "hang", "crash")]
    assert not bad, bad


def test_every_refusal_names_the_layer_or_feature(swept):
    vague = [(f, k, c["reason"]) for f, k, c in _cases(swept.rows)
             if c["verdict"] == "refused" and not zoo.refusal_names_something(swept.rows[f], c["reason"])]
    assert not vague, vague


def test_exact_fraction_and_table_match(swept):
    s = zoo.summary(swept.rows, SUITE_CASES)
    print(f"\nzoo: {s} in {swept.seconds:.0f}s")
    for b, P in SUITE_CASES:
        counts = s[f"{b}{P}"]
        print(f"{b} P={P}: exact {counts.get('exact', 0)}/{s['scored']} "
              f"({counts.get('exact', 0) / max(s['scored'], 1):.0%})")
    keys = _keys(swept.rows)
    committed = _suite(zoo_table.parse(open(zoo_table.DOC).read()), keys)
    fresh = _suite(zoo_table.verdicts(swept.rows), keys)
    assert set(keys) == set(zoo.causal_lm_families())
    lost = sorted((f, k) for f, row in committed.items() for k, v in row.items()
                  if v == "exact" and fresh.get(f, {}).get(k) != "exact")
    assert not lost, f"the coverage table says these are exact and they are not now: {lost}"
    diff = {f: (committed.get(f), fresh.get(f)) for f in set(committed) | set(fresh) if committed.get(f) != fresh.get(f)}
    assert not diff, f"docs/models.md's zoo table differs from this run; run python tools/zoo_table.py: {diff}"


def test_families_come_from_transformers_and_encoder_decoders_are_excluded():
    families = zoo.causal_lm_families()
    assert len(families) > 150 and "llama" in families and "phi3" in families
    assert zoo.is_encoder_decoder("bart") and not zoo.is_encoder_decoder("llama")


def test_tiny_config_is_generic_and_small():
    for family in ("phi3", "mixtral", "gpt2", "deepseek_v3", "gemma2"):
        config = zoo.tiny_config(family)
        text = config.get_text_config()
        assert text.hidden_size == 64 and text.num_hidden_layers <= 4 and text.vocab_size == 128, family
    assert zoo.tiny_config("mixtral").num_local_experts == 4
    # one layer of each kind: gemma3_text's 5 sliding + 1 full layers become sliding, full
    assert zoo.tiny_config("gemma3_text").layer_types == ["sliding_attention", "full_attention"]
