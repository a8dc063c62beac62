"""Check ringmaster's layering: no import cycle, no function-level import inside the core, the core
never imports tooling or adapters, and the leaves import nothing from the package.

    python tools/import_graph.py        # prints the violations; exit status 1 if any

Reads the source with ``ast`` (imports nothing).
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ringmaster")

CORE = ("ringmaster.comm", "ringmaster.mesh", "ringmaster.validation", "ringmaster.runtime", "ringmaster.sharding",
        "ringmaster.attention", "ringmaster.recurrent", "ringmaster.architectures", "ringmaster.multimodal",
        "ringmaster.wiring", "ringmaster.config", "ringmaster.errors", "ringmaster.compat", "ringmaster.checkpointing",
        "ringmaster.tiling")
TOOLING = ("ringmaster.profiling", "ringmaster.bench", "ringmaster.testing", "ringmaster.cli",
           "ringmaster.planning", "ringmaster.memory_plan", "ringmaster.adapters")
LEAVES = ("ringmaster.config", "ringmaster.errors", "ringmaster.checkpointing", "ringmaster.attention.binding",
          "ringmaster.recurrent.kind")


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def modules() -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel[:-9] if rel.endswith(".__init__") else rel] = path
    return found


def _targets(current: str, node, is_pkg: bool, known) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = current.split(".")
            if not is_pkg:
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
    return [a.name for a in node.names]


def graph():
    known = modules()
    top: dict[str, set[str]] = {}
    nested: list[tuple[str, int, str]] = []
    for name, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        is_pkg = path.endswith("__init__.py")
        top_nodes = set()
        for stmt in tree.body:
            top_nodes.add(stmt)
            if isinstance(stmt, (ast.Try, ast.If)):
                top_nodes.update(stmt.body)
                for handler in getattr(stmt, "handlers", []):
                    top_nodes.update(handler.body)
        top[name] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, node, is_pkg, known):
                if not target.startswith("ringmaster"):
                    continue
                if node in top_nodes:
                    if target in known:
                        top[name].add(target)
                else:
                    nested.append((name, node.lineno, target))
    return top, nested


def cycles(top: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in top.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in top:
        if v not in index:
            visit(v)
    return out


def violations() -> list[str]:
    top, nested = graph()
    out = [f"import cycle: {' <-> '.join(c)}" for c in cycles(top)]
    out += [f"{m}:{line} imports {t} inside a function (core modules import at the top)"
            for m, line, t in nested if _in(m, CORE)]
    for m, targets in top.items():
        if _in(m, CORE):
            out += [f"{m} (core) imports {t} (tooling/adapter)" for t in targets if _in(t, TOOLING)]
        if m in LEAVES:
            out += [f"{m} is a leaf but imports {t}" for t in targets]
    return out


if __name__ == "__main__":
    problems = violations()
    for p in problems:
        print(p)
    print(f"{len(problems)} layering violation(s)")
    sys.exit(1 if problems else 0)
