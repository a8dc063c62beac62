"""The code blocks of the docs run, so they never rot.

Every ```python block of a page runs in order, in one namespace per page, on every rank of the
session's 4 CPU gloo ranks (torch.distributed initialised, as under torchrun). A block whose
first line is ``# not run`` is only shown.
"""

from __future__ import annotations

import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
PAGES = ["api.md", "models.md", "concepts.md"]
SKIP_MARK = re.compile(r"^#\s*not run\b", re.IGNORECASE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, source)`` of every ```python block that is not marked ``# not run``."""
    blocks = []
    for match in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.MULTILINE | re.DOTALL):
        source = match.group(1)
        first = next((line for line in source.splitlines() if line.strip()), "")
        if SKIP_MARK.match(first.strip()):
            continue
        blocks.append((text.count("\n", 0, match.start()) + 2, source))
    return blocks


def run_blocks(ctx, page: str, blocks: list[tuple[int, str]]):
    """Pool job: exec each block on this rank; returns the captured stdout."""
    import contextlib
    import io

    import ringmaster as rm
    from ringmaster.architectures import spec as architectures

    registry = dict(architectures._REGISTRY)   # a page may register families: undo it afterwards
    namespace = {"__name__": f"docs_{page}"}
    out = io.StringIO()
    try:
        for line, source in blocks:
            code = compile(source, f"docs/{page}:{line}", "exec")
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
    finally:
        rm.teardown()
        for value in list(namespace.values()):  # leave no wired model behind in the shared pool
            if getattr(value, "_ringmaster_runtime", None) is not None:
                rm.unwire(value)
        architectures._REGISTRY.clear()
        architectures._REGISTRY.update(registry)
    return out.getvalue()


def test_blocks_are_found_and_skippable():
    text = "x\n```python\nprint(1)\n```\n```python\n# not run\nboom()\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "print(1)\n")]


@pytest.mark.parametrize("page", PAGES)
def test_doc_blocks_run(pool, page):
    path = os.path.join(DOCS, page)
    if not os.path.exists(path):
        pytest.skip(f"docs/{page} does not exist")
    with open(path) as f:
        blocks = python_blocks(f.read())
    if not blocks:
        pytest.skip(f"docs/{page} has no runnable python block")
    outputs = pool.run(run_blocks, page, blocks)
    assert len(outputs) == pool.world
