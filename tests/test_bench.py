"""`ringmaster bench --quick` completes and prints both tables (smoke test on the session's pool)."""

from __future__ import annotations

import contextlib
import csv

import ringmaster_tools.bench as bench_module
from ringmaster.cli import main


class _Borrowed:
    """The session pool, lent to the CLI without being closed."""

    def __init__(self, pool):
        self.pool, self.world = pool, pool.world

    def run(self, fn, *args, **kwargs):
        return self.pool.run(fn, *args, **kwargs)

    def close(self):
        pass


def test_bench_quick_prints_both_tables(pool, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_module, "make_pool", lambda world, timeout=600.0: _Borrowed(pool))
    assert main(["bench", "--quick", "--no-progress", "--max-seq", "256", "--peer-seq", "256",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CP vs non-CP" in out and "step s" in out
    for model in ("llama", "qwen3_5-hybrid"):
        assert f"{model:<15} {256:>6}  1 none" in out, out       # non-CP reference row
        assert f"{model:<15} {256:>6}  4 " in out, out            # CP at P=4
    for system in ("ringmaster ulysses", "ringmaster ring p2p", "ringmaster ring allgather",
                   "ringmaster ring distflash", "torch cp alltoall", "torch cp allgather", "deepspeed ulysses",
                   "yunchang ulysses", "ring-flash-attn zigzag", "yunchang ring zigzag",
                   "baseline allgather+sdpa"):
        assert system in out
    assert "max rel err" in out and "vs rm" in out and "rm rec f+b" in out
    assert (tmp_path / "cp_vs_noncp.csv").read_text().startswith("model,P,backend,seq")
    rows = {(r["P"], r["system"]): r for r in csv.DictReader((tmp_path / "peers.csv").open())}
    assert rows[("2", "torch cp alltoall")]["status"] == "ok"      # measured, not skipped (CPU rules)
    assert (tmp_path / "peers.png").exists() or "matplotlib is not installed" in out


def test_progress_bar_plain_text(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    bar = bench_module.Progress(2, "bench")
    bar.update("one")
    bar.update("two")
    bar.close()
    err = capsys.readouterr().err
    assert "2/2" in err and "#" in err
    with contextlib.suppress(Exception):
        bench_module.Progress(1, enabled=False).update()
