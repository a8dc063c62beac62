"""docs/models.md's recurrent-family coverage table is the one ringmaster_tools.coverage derives from the
registries, every recurrent family is in it, and every mutation test it names exists (cheap: no model runs)."""

import os
import re

from ringmaster.architectures import spec
from ringmaster_tools import coverage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the recurrent families issue 16 lists, each of which must be a row (by model type)
LISTED = ("mamba", "falcon_mamba", "jamba", "zamba", "mamba2", "zamba2", "nemotron_h", "bamba", "falcon_h1",
          "granitemoehybrid", "lfm2", "lfm2_moe", "lfm3", "inkling_text", "inkling2_text", "inkling2_loop_text",
          "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini", "bailing_hybrid",
          "kimi_linear", "minimax", "recurrent_gemma", "rwkv", "xlstm")


def test_docs_table_is_generated():
    text = open(os.path.join(ROOT, "docs", "models.md")).read()
    start, end = text.index(coverage.BEGIN), text.index(coverage.END) + len(coverage.END)
    assert text[start:end] == coverage.markdown(), "run `python -m ringmaster_tools.coverage` and paste the table"


def test_every_recurrent_family_is_a_row():
    families = {t for r in coverage.rows() for t in r.family.split(", ")}
    recurrent = {t for t, s in spec._REGISTRY.items() if s.recurrent_classes}
    assert recurrent == families
    assert set(LISTED) <= families, sorted(set(LISTED) - families)
    for r in coverage.rows():
        refused = bool(spec._REGISTRY[r.family.split(", ")[0]].refuse)
        assert r.status.startswith("refused: ") == refused, r


def test_mutation_tests_exist():
    for r in coverage.rows():
        assert r.mutations, r
        for node in r.mutations:
            path, name = node.split("::")
            source = open(os.path.join(ROOT, path)).read()
            assert re.search(rf"^def {name}\(", source, re.M), node
