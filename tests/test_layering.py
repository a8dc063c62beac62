"""The package's layering holds (tools/import_graph.py): no import cycle, no function-level import
in the core, the core never imports tooling or adapters, leaves import nothing from the package;
and ``import ringmaster`` loads no tooling."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_no_layering_violation():
    import import_graph

    assert import_graph.violations() == []


def test_the_checker_can_fail(tmp_path, monkeypatch):
    """A cycle and a nested import planted in a copy of two modules are reported."""
    import import_graph

    top = {"ringmaster.runtime": {"ringmaster.wiring"}, "ringmaster.wiring": {"ringmaster.runtime"}}
    assert import_graph.cycles(top) == [["ringmaster.runtime", "ringmaster.wiring"]]
    monkeypatch.setattr(import_graph, "graph", lambda: ({"ringmaster.config": {"ringmaster.comm"}},
                                                        [("ringmaster.runtime", 3, "ringmaster.attention")]))
    found = import_graph.violations()
    assert any("inside a function" in v for v in found) and any("leaf" in v for v in found), found


def test_import_ringmaster_loads_no_tooling():
    code = ("import sys, ringmaster; bad = [m for m in sys.modules if m.startswith('ringmaster.') and m.split('.')[1] in "
            "('profiling', 'bench', 'testing', 'cli', 'planning', 'memory_plan', 'adapters')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout
