"""examples/raw_fsdp2.py under torchrun on CPU: 4 gloo ranks, dp_shard=2 x cp=2, FSDP2."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_raw_fsdp2_example_runs_with_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "examples", "raw_fsdp2.py"), "--steps", "5", "--seq-len", "64"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    parity = re.findall(r"step 0 loss parity: cp=([\d.]+) single-device=([\d.]+) rel_err=([\d.e+-]+)", out)
    assert len(parity) == 4, out[-4000:]  # every rank checks its dp group's loss
    assert all(float(err) <= 1e-4 for *_, err in parity), parity
    assert "(decreasing)" in out, out[-4000:]
