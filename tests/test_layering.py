"""The package's layering holds (tools/import_graph.py): imports only go down the layers (no upward or
sideways import), every module has a layer, no import cycle, no function-level import in the core, the
leaves import nothing from the package, and the training path never imports the tooling or the test
doubles; ``import ringmaster`` and a whole ``rm.wire`` + CP step load none of them."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import import_graph  # noqa: E402

NOT_TRAINING_PATH = ("ringmaster_tools", "standins", "fla", "mamba_ssm", "causal_conv1d", "flash_attn")


def test_no_layering_violation():
    assert import_graph.violations() == []


def test_every_module_has_a_layer_and_the_layers_are_ordered_as_the_design_says():
    names = [name for name, _ in import_graph.LAYERS]
    assert names == ["base", "runtime", "step", "ops", "architectures", "multimodal", "wiring", "adapters", "cli",
                     "package"]
    for module in import_graph.modules():
        assert import_graph.place(module) is not None, module
    assert import_graph.place("ringmaster")[1] == "package"
    assert import_graph.place("ringmaster.sharding.batch")[1] == "step"
    assert import_graph.place("ringmaster.attention.binding")[1] == "base"   # a leaf
    assert import_graph.direction("ringmaster.sharding.batch", "ringmaster.runtime") is None
    assert import_graph.direction("ringmaster.runtime", "ringmaster.attention.register") == "upward"
    assert import_graph.direction("ringmaster.attention.selfattn", "ringmaster.recurrent.scan") == "sideways"


def _plant(path: str, line: str, at_top: bool = True) -> None:
    with open(path) as f:
        text = f.read()
    if at_top:
        text += f"\n{line}\n"
    else:
        text += f"\n\ndef _planted():\n    {line}\n"
    with open(path, "w") as f:
        f.write(text)


def test_the_checker_reports_planted_violations(tmp_path):
    """A copy of the package with one violation of each kind planted: every one is reported, and the
    unplanted copy is clean."""
    for package in ("ringmaster", "ringmaster_tools"):
        shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    root = str(tmp_path)
    assert import_graph.violations(root) == []
    pkg = tmp_path / "ringmaster"
    _plant(pkg / "sharding" / "balancers.py", "from ..wiring import wire")                  # upward (and a cycle)
    _plant(pkg / "attention" / "ulysses.py", "from ..recurrent import scan")                # sideways
    _plant(pkg / "comm.py", "from ringmaster_tools import profiling", at_top=False)        # core -> tooling
    _plant(pkg / "wiring.py", "from .runtime import active", at_top=False)                 # nested in the core
    _plant(pkg / "recurrent" / "conv.py", "import standins.naive")                          # a test double
    _plant(pkg / "config.py", "from .errors import UnsupportedLayerError")                  # a leaf importing
    _plant(pkg / "cli.py", "import ringmaster_tools.bench")                                 # tooling at cli's top
    (pkg / "newthing.py").write_text('"""a module nobody placed"""\n')
    found = "\n".join(import_graph.violations(root))
    assert "ringmaster.sharding.balancers:" in found and "imports ringmaster.wiring (upward" in found, found
    assert "import cycle:" in found and "ringmaster.sharding.balancers" in found, found
    assert "ringmaster.attention.ulysses:" in found and "imports ringmaster.recurrent.scan (sideways" in found, found
    assert "ringmaster.comm:" in found and "never imports the tooling" in found, found
    assert "ringmaster.wiring:" in found and "inside a function" in found, found
    assert "ringmaster.recurrent.conv:" in found and "test doubles" in found, found
    assert "ringmaster.config is a leaf but imports ringmaster.errors" in found, found
    assert "ringmaster.cli:" in found and "at module top" in found, found
    assert "ringmaster.newthing has no layer" in found, found


def test_cycles_are_found():
    top = {"ringmaster.runtime": {"ringmaster.wiring"}, "ringmaster.wiring": {"ringmaster.runtime"}}
    assert import_graph.cycles(top) == [["ringmaster.runtime", "ringmaster.wiring"]]


_REPORT = f"import sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {NOT_TRAINING_PATH!r}))\n"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> list[str]:
    """One fresh process (a Python start and torch's import are most of its time): what is loaded from
    NOT_TRAINING_PATH after ``import ringmaster``, then after ``rm.wire`` on a model and one CP forward/backward
    (one gloo rank)."""
    rendezvous = tmp_path_factory.mktemp("layering") / "rendezvous"
    code = f"""import ringmaster
{_REPORT}
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=0, world_size=1)
import ringmaster as rm
from ringmaster.adapters.raw import context_parallel_region
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2))
runtime = rm.wire(model, rm.RingmasterConfig(size=1))
ids = torch.randint(0, 64, (1, 16))
with context_parallel_region({{"input_ids": ids, "labels": ids}}, runtime=runtime) as shard:
    model(**shard).loss.backward()
rm.unwire(model)
dist.destroy_process_group()
{_REPORT}"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-2:]


def test_import_ringmaster_loads_no_tooling(loaded):
    assert loaded[0] == "[]"


def test_wire_and_a_cp_step_load_no_tooling(loaded):
    """``rm.wire`` on a model and one CP forward/backward (one gloo rank) import no tooling, stand-in or
    fake package: what the training path loads is the library alone."""
    assert loaded[1] == "[]"
