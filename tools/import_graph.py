"""Check ringmaster's layering: imports only go down, the leaves import nothing from the package, the core
imports at module top (no import cycle, no function-level import closing one), and the training path never
imports the tooling or the test doubles.

    python tools/import_graph.py          # prints the violations; exit status 1 if any
    python tools/import_graph.py --graph  # every module's level and what it imports

Reads the source with ``ast`` (imports nothing). The layers are data (:data:`LAYERS`), lowest first:

    base <- runtime <- step <- ops <- architectures <- multimodal <- wiring <- adapters <- cli <- package

A module may import from its own group and from any lower layer; an import of a higher layer ("upward")
or of another group of its own layer ("sideways": attention and recurrent are siblings, neither imports the
other) is a violation. This applies to function-level imports too (they still make the lower module depend
on the higher one). Every module of the package must be placed in a layer: a new one that is not is a
violation too, so its place is decided, not defaulted.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE, TOOLING = "ringmaster", "ringmaster_tools"
TEST_DOUBLES = ("standins", "tests")   # tests/standins: stand-in packages and fp64 references, never shipped

# lowest first; a layer maps each of its groups to the module prefixes it holds (the longest prefix wins)
LAYERS: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("base", {"base": ("ringmaster.config", "ringmaster.errors", "ringmaster.compat", "ringmaster.checkpointing",
                       "ringmaster.attention.binding", "ringmaster.recurrent.kind")}),
    # groups, sizes, the current runtime; the collectives; re-binding a module instance's kernel names
    ("runtime", {"runtime": ("ringmaster.comm", "ringmaster.mesh", "ringmaster.validation", "ringmaster.runtime",
                             "ringmaster.intercept")}),
    ("step", {"step": ("ringmaster.sharding",)}),
    ("ops", {"attention": ("ringmaster.attention",), "recurrent": ("ringmaster.recurrent",),
             "tiling": ("ringmaster.tiling", "ringmaster.per_token")}),
    ("architectures", {"architectures": ("ringmaster.architectures",)}),
    ("multimodal", {"multimodal": ("ringmaster.multimodal",)}),
    # wire time: classify the model (architectures/), validate, bind, swap. recurrent/wiring.py is the recurrent
    # half of it (rm.wire_recurrent_layers looks the family up), so it sits here although it lives in recurrent/
    ("wiring", {"wiring": ("ringmaster.wiring", "ringmaster.recurrent.wiring")}),
    ("adapters", {"adapters": ("ringmaster.adapters",),
                  # the import paths axolotl 0.21 calls (thin re-exports)
                  "axolotl_paths": ("ringmaster.strategies", "ringmaster.shard", "ringmaster.fla_mamba")}),
    ("cli", {"cli": ("ringmaster.cli", "ringmaster.__main__")}),
    ("package", {"package": ("ringmaster",)}),   # __init__: the public names (matches only itself)
)
LEAVES = ("ringmaster.config", "ringmaster.errors", "ringmaster.checkpointing", "ringmaster.attention.binding",
          "ringmaster.recurrent.kind")
# may import the tooling, inside a function only: the CLI's commands, the lazy rm.profile_comms/profile_memory
LOADS_TOOLING_LAZILY = ("ringmaster.cli", "ringmaster")
# the core imports at module top only (adapters, cli and the package root may import inside functions)
NESTED_OK = ("ringmaster.adapters", "ringmaster.cli", "ringmaster.__main__")


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def place(module: str) -> tuple[int, str] | None:
    """``(layer index, group)`` of a package module, or None when no layer holds it."""
    best = None
    for index, (_, groups) in enumerate(LAYERS):
        for group, prefixes in groups.items():
            for p in prefixes:
                hit = module == p if group == "package" else (module == p or module.startswith(p + "."))
                if hit and (best is None or len(p) > best[0]):
                    best = (len(p), index, group)
    return None if best is None else best[1:]


def modules(root: str = REPO, package: str = PACKAGE) -> dict[str, str]:
    found = {}
    base = os.path.join(root, package)
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
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


def _top_nodes(tree) -> set:
    top = set()
    for stmt in tree.body:
        top.add(stmt)
        if isinstance(stmt, (ast.Try, ast.If)):
            top.update(stmt.body)
            top.update(stmt.orelse)
            for handler in getattr(stmt, "handlers", []):
                top.update(handler.body)
    return top


def imports(root: str = REPO) -> list[tuple[str, int, str, bool]]:
    """Every import made by the package and the tooling: ``(module, line, target, at module top)``; targets
    outside the package, the tooling and the test doubles are left out."""
    known = {**modules(root, PACKAGE), **modules(root, TOOLING)}
    out = []
    for name, path in sorted(known.items()):
        with open(path) as f:
            tree = ast.parse(f.read())
        top = _top_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, node, path.endswith("__init__.py"), known):
                if _in(target, (PACKAGE, TOOLING) + TEST_DOUBLES):
                    out.append((name, node.lineno, target, node in top))
    return out


def graph(root: str = REPO):
    """``(top, nested)``: the package's module-top import graph, and its function-level imports."""
    known = modules(root, PACKAGE)
    top: dict[str, set[str]] = {m: set() for m in known}
    nested: list[tuple[str, int, str]] = []
    for m, line, target, at_top in imports(root):
        if m not in known or not _in(target, (PACKAGE,)):
            continue
        if at_top:
            if target in known:
                top[m].add(target)
        else:
            nested.append((m, line, target))
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


def direction(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target`` (both in the package): "upward" or "sideways"; None if it may."""
    here, there = place(module), place(target)
    if here is None or there is None:
        return None   # reported as unplaced
    if there[0] > here[0]:
        return "upward"
    if there[0] == here[0] and there[1] != here[1]:
        return "sideways"
    return None


def upward(root: str = REPO) -> list[tuple[str, int, str, str]]:
    """``(module, line, target, "upward" | "sideways")`` for every import against the layer order."""
    known = modules(root, PACKAGE)
    out = []
    for m, line, target, _ in imports(root):
        if m in known and _in(target, (PACKAGE,)):
            why = direction(m, target)
            if why:
                out.append((m, line, target, why))
    return out


def violations(root: str = REPO) -> list[str]:
    known = modules(root, PACKAGE)
    top, nested = graph(root)
    out = [f"import cycle: {' <-> '.join(c)}" for c in cycles(top)]
    out += [f"{m} has no layer: place it in tools/import_graph.py LAYERS" for m in sorted(known) if place(m) is None]
    out += [f"{m}:{line} imports {t} ({why}: {LAYERS[place(m)[0]][0]}/{place(m)[1]} -> "
            f"{LAYERS[place(t)[0]][0]}/{place(t)[1]})" for m, line, t, why in upward(root)]
    out += [f"{m}:{line} imports {t} inside a function (core modules import at the top)"
            for m, line, t in nested if m != PACKAGE and not _in(m, NESTED_OK)]
    for m, line, t, at_top in imports(root):
        if m in known and _in(t, (TOOLING,)):
            if m not in LOADS_TOOLING_LAZILY:
                out.append(f"{m}:{line} imports {t} (the training path never imports the tooling)")
            elif at_top:
                out.append(f"{m}:{line} imports {t} at module top (load the tooling inside the function that uses it)")
        if _in(t, TEST_DOUBLES):
            out.append(f"{m}:{line} imports {t} (test doubles live in tests/ and never ship)")
    for m, targets in top.items():
        if m in LEAVES:
            out += [f"{m} is a leaf but imports {t}" for t in sorted(targets)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", action="store_true", help="print each module's layer and its imports")
    ap.add_argument("--root", default=REPO, help="a checkout to check (default: this one)")
    args = ap.parse_args(argv)
    if args.graph:
        top, _ = graph(args.root)
        for m in sorted(top):
            p = place(m)
            where = f"{LAYERS[p[0]][0]}/{p[1]}" if p else "UNPLACED"
            print(f"{m:45s} {where:28s} {', '.join(sorted(top[m]))}")
    problems = violations(args.root)
    for p in problems:
        print(p)
    print(f"{len(problems)} layering violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
