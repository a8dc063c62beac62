"""``ringmaster plan`` (issue 39): when nothing fits it names the flags that would make something fit; it refuses a
flag the planner it runs would ignore (``--documents`` beside ``--config`` was silently ignored); its help describes
both planners, the memory planner the README leads with and the split planner."""

from __future__ import annotations

import argparse
import os

import pytest

from ringmaster.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_8B = os.path.join(ROOT, "benchmarks", "configs", "qwen3-8b")


def _rows(out: str) -> dict[str, list[str]]:
    """The hint table's rows: flags -> the three cells (ckpt none / full / offload)."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  --"):
            *flags, a, b, c = line.split()
            rows[" ".join(flags)] = [a, b, c]
    return rows


def test_nothing_fits_names_what_to_change(capsys):
    """An 8B model on 8 x 80 GiB without FSDP2: every backend 0 in every column, and the hint says that the static
    part alone is over the budget and that --fsdp full (with --loss chunked, --optimizer fused) makes it fit."""
    assert main(["plan", "--config", QWEN3_8B, "--seq", "131072", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits in 80 GiB per GPU" in out and "alone take 106.80 GiB per rank" in out, out
    rows = _rows(out)
    assert rows["--fsdp full"] != ["0", "0", "0"], rows
    assert rows["--fsdp full --loss chunked --optimizer fused"] == ["69K", "982K", "1.88M"], rows   # = the README's
    assert rows["--loss chunked"] == ["0", "0", "0"], rows
    assert "--gpus 16" in " ".join(rows), rows


def test_no_hint_when_something_fits(capsys):
    assert main(["plan", "--config", QWEN3_8B, "--seq", "131072", "--gpus", "8", "--fsdp", "full"]) == 0
    assert "nothing fits" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag, why", [
    (["--config", "llama", "--seq", "8192", "--documents", "512,512"], "--documents", "split planner"),
    (["--config", "llama", "--seq", "8192", "--heads", "32"], "--heads", "split planner"),
    (["--heads", "32", "--kv-heads", "8", "--world", "8", "--hidden", "4096", "--seq", "8192", "--fsdp", "full"],
     "--fsdp", "memory planner"),
    (["--heads", "32", "--kv-heads", "8", "--world", "8", "--hidden", "4096", "--seq", "8192", "--checkpointing",
      "full", "--gpus", "8"], "--gpus --checkpointing", "memory planner"),
])
def test_flags_the_planner_ignores_are_refused(argv, flag, why):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    text = str(exc.value)
    assert text.startswith(f"ringmaster plan: {flag}: read only by the {why}"), text


def test_help_describes_both_planners():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["plan"].format_help()
    assert "Memory planner (--config" in text and "Split planner (--heads" in text, text
    assert "memory planner (--config):" in text and "split planner (no --config):" in text, text   # the flag groups
    assert "--fsdp full" in text and "longest" in text and "auto_select" in text
    assert "memory planner" in sub._choices_actions[[a.dest for a in sub._choices_actions].index("plan")].help
