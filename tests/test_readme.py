"""The README a newcomer reads: it names nothing outside the repository, its install line installs
what CI installs (so no test CI runs is skipped on a newcomer's machine), and it links the map,
docs/architecture.md, which has the sections the developers' guide promises.

Issue 13 found the README pointing at a design document outside the repository and an install
line without axolotl (7 tests skipped); these checks fail on that README.
"""

from __future__ import annotations

import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


# a path-like token: `docs/x.md`, (docs/x.md), examples/raw_fsdp2.py, ../shared/DESIGN.md, /abs/path
_PATH = re.compile(r"(?<![\w.:/-])((?:\.\.?/|/)?[\w.-]+(?:/[\w.*-]+)+/?)")
_TOP = ("docs", "examples", "benchmarks", "tests", "tools", "ringmaster", ".ci", "..", ".")


def repo_paths(text: str) -> list[str]:
    """Every token of ``text`` that names a file or folder by a relative or absolute path (URLs and
    ``org/repo``-style names that do not start at a top-level folder are left out)."""
    found = []
    for match in _PATH.finditer(text):
        token = match.group(1).rstrip(".")
        if "://" in text[max(0, match.start() - 8):match.start() + 3]:
            continue
        if token.startswith("/") or token.split("/")[0] in _TOP:
            found.append(token)
    return found


def test_readme_names_nothing_outside_the_repository():
    text = _read("README.md")
    paths = repo_paths(text)
    assert "docs/architecture.md" in paths, "the README must link the map, docs/architecture.md"
    outside = [p for p in paths if p.startswith(("/", "..")) or "DESIGN.md" in p]
    assert not outside, f"README names paths outside the repository: {outside}"
    missing = [p for p in paths if "*" not in p and not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README names paths that do not exist in the repository: {missing}"


def _pip_installs(text: str) -> list[list[str]]:
    """The argument lists of every ``pip install`` command in ``text`` (in a code block or inline;
    ``-q`` dropped; a command ends at a backtick, ``&&``, ``#`` or the line's end)."""
    out = []
    for match in re.finditer(r"pip install([^`&#\n]*)", text):
        try:
            words = shlex.split(match.group(1))
        except ValueError:
            continue
        out.append([w for w in words if w != "-q"])
    return out


def test_readme_install_line_installs_what_ci_installs():
    """Every ``pip install`` of .ci/run (torch, the dev extra, axolotl without deps) is in the README's
    quick start, with the same arguments."""
    ci = _pip_installs(_read(".ci", "run"))
    readme = _pip_installs(_read("README.md"))
    assert any("axolotl" in " ".join(args) for args in ci), ci
    missing = [args for args in ci if args not in readme]
    assert not missing, f"README's install line lacks what CI installs: {missing} (README has {readme})"


def test_architecture_doc_has_the_promised_sections():
    headings = re.findall(r"^## (.+)$", _read("docs", "architecture.md"), re.MULTILINE)
    for needed in ("One training step", "Layering rules", "Adding a model family", "Adding a recurrent kind",
                   "Adding a ring block kernel"):
        assert needed in headings, (needed, headings)
    paths = repo_paths(_read("docs", "architecture.md"))
    outside = [p for p in paths if p.startswith(("/", "..")) or "DESIGN.md" in p]
    assert not outside, outside


def test_the_checks_can_fail():
    """The README issue 13 found (design doc outside the repo, install line without axolotl)."""
    old = ("Install torch first: `pip install torch==2.13.0`, then `pip install -e \".[dev]\"`.\n"
           "See `../shared/DESIGN.md` for the architecture. The map: docs/architecture.md\n")
    paths = repo_paths(old)
    assert "../shared/DESIGN.md" in paths and "docs/architecture.md" in paths, paths
    readme = _pip_installs("pip install torch==2.13.0 && pip install -e \".[dev]\"")
    ci = _pip_installs(_read(".ci", "run"))
    assert [args for args in ci if args not in readme], "an install line without axolotl must be caught"
    assert not repo_paths("see https://github.com/org/repo/blob/main/x.md and kernels-community/flash-attn")
