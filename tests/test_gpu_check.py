"""The one-GPU check's plumbing on CPU, so the script runs the day a GPU is lent: every parity row
(bf16 CP vs the fp32 truth, next to non-CP bf16) is computed through the same code the GPU run
uses, with the hub flash names resolved to the CPU stand-in. Flex has no CPU backward in torch 2.13:
that row must say so, not pass."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(table: str) -> list[tuple[str, int, str]]:
    """(case, P, verdict) of each row of a parity table (gpu_check.parity_table)."""
    cells = [line.split("|") for line in table.splitlines()
             if line.startswith("| ") and "---" not in line and not line.startswith("| case |")]
    return [(c[1].strip(), int(c[2]), c[-2].strip()) for c in cells]


def test_gpu_check_cpu_smoke_run(pool, tmp_path):
    """The script end to end at P=2 (its own spawned ranks, the table it writes); its P=4 rows through the same
    ``parity_job`` on the session pool's four ranks (a second spawn of four processes cost most of this test)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check
    import jobs_gpu_check

    out = tmp_path / "gpu_check.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--device", "cpu",
                           "--quick", "--skip-memory", "--sizes", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out.read_text()) + _rows(gpu_check.parity_table(pool.run(jobs_gpu_check.parity_rows)[0]))
    assert sorted({P for _, P, _ in rows}) == [2, 4], rows
    verdicts = {case: verdict for case, _, verdict in rows}
    assert len(verdicts) >= 15, verdicts
    assert verdicts.pop("ulysses flex").startswith("error: NotImplementedError: FlexAttention does not support "
                                                   "backward on CPU"), verdicts
    assert all(v == "ok" for v in verdicts.values()), verdicts
    assert {"ring aten distflash", "ring flash-attn2", "ulysses flash-attn2", "usp 2x2 aten"} <= set(verdicts)


def test_gpu_check_memory_rows_carry_the_plan():
    """The GPU run's memory rows print the planner's peak for the same step beside the measured one
    (the CPU smoke skips the memory rows: this is their plumbing)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check

    for name, overrides in (("llama", gpu_check.QUICK_LLAMA), ("hybrid", gpu_check.QUICK_HYBRID)):
        ref, kernel = gpu_check.planned_peak(name, overrides, 256, 1, "ulysses")
        cp, _ = gpu_check.planned_peak(name, overrides, 256, 2, "ulysses")
        assert kernel == "torch" and 0 < cp < ref, (name, ref, cp)
    row = {"model": "llama-1B", "S": 256, "ref": {"peak": ref / 0.95, "time": 0.1},
           "cp": {"peak": cp / 1.05, "time": 0.1, "backend": "ulysses"}, "planned": (ref, cp, kernel)}
    line = gpu_check.memory_table([row]).splitlines()[-1]
    assert "(torch) | 0.95, 1.05 |" in line, line
