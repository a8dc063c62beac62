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


# ---- issue 39: the README's snippets run as written, its commands exist, its install lines are true -------------

def readme_commands(text: str) -> list[list[str]]:
    """Every ``ringmaster <command> ...`` the README shows (code blocks, ``$`` prompts, inline code), as argv
    lists without the program name; lines continued with a backslash joined, comments dropped, placeholders
    (``<config.json | ...>``, ``...``) left out."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for match in re.finditer(r"(?:^\$ |^|`)ringmaster ((?:demo|check|plan|bench)\b[^`#\n]*)", text, re.MULTILINE):
        command = match.group(1).strip()
        if "<" in command or "..." in command:
            continue
        found.append(shlex.split(command))
    return found


def test_readme_commands_parse_and_their_help_exits_0():
    """Every ringmaster command the README shows parses with the CLI's own parser (no flag it lacks), and each
    subcommand's --help exits 0; the console script points at that CLI."""
    import pytest

    from ringmaster.cli import build_parser, main

    commands = readme_commands(_read("README.md"))
    subcommands = {argv[0] for argv in commands}
    assert {"demo", "check", "plan", "bench"} <= subcommands, commands
    parser = build_parser()
    for argv in commands:
        if "--help" not in argv:
            assert parser.parse_args(argv).func is not None, argv
    for argv in [[sub, "--help"] for sub in sorted(subcommands)] + [argv for argv in commands if "--help" in argv]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0, argv
    assert re.search(r'^ringmaster = "ringmaster\.cli:main"$', _read("pyproject.toml"), re.MULTILINE)


def test_readme_command_extraction_can_fail():
    assert readme_commands("`ringmaster plan --config x --seq 8 --fsdp full`\n$ ringmaster demo --model a \\\n"
                           "    --world 2   # two ranks\n`ringmaster check <config.json>`") == [
        ["plan", "--config", "x", "--seq", "8", "--fsdp", "full"], ["demo", "--model", "a", "--world", "2"]]
    from ringmaster.cli import build_parser

    try:
        build_parser().parse_args(["plan", "--seq", "8", "--no-such-flag"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown flag must not parse")


def test_quick_start_commands_are_what_ci_runs():
    """The quick start's two commands, exactly as .ci/run runs them after the developer install."""
    readme, ci = _read("README.md"), _read(".ci", "run").splitlines()
    for command in ("ringmaster demo", "python -m pytest -q -n 2 tests"):
        assert re.search(rf"^{re.escape(command)}\s+#", readme, re.MULTILINE), command
        assert command in ci, command


def test_user_install_and_the_other_pypi_project():
    """The README's user install (torch first, then the hf extra from a clone) is true of pyproject.toml, and it says
    that the PyPI project of the same distribution name is another project (issue 39)."""
    readme, pyproject = _read("README.md"), _read("pyproject.toml")
    installs = _pip_installs(readme)
    assert ["-e", ".[hf]"] in installs, installs
    assert installs.index(["torch"]) < installs.index(["-e", ".[hf]"]), installs     # torch first
    assert re.search(r'^name = "axolotl-ringmaster"$', pyproject, re.MULTILINE)
    assert re.search(r"^hf = \[", pyproject, re.MULTILINE), "the hf extra the README installs"
    install = readme[readme.index("## Install"):readme.index("## Quick start")]
    for words in ("From a clone", "CPU wheel", "CUDA wheel", "different project", "another package layout",
                  "no `ringmaster` command", "no `hf` extra", "axolotl-ringmaster"):
        assert words in install, words
    quick = readme[readme.index("## Quick start"):readme.index("## Use")]
    assert "developer install" in quick


USE_PREAMBLE_SEQ = 64


def run_readme_python(ctx, blocks: list[tuple[int, str]], packed: bool):
    """Pool job (every rank, torch.distributed already initialised as under torchrun): the README's python blocks
    in order, in one namespace holding only ``model`` (a tiny llama, use_cache on as a hub config has it) and
    ``batch`` (one row, or a packed row of two documents with position_ids restarting at 0). Returns the gathered
    logits' and the group-mean loss's errors against the model without CP, run as the README says (use_cache=False)."""
    import contextlib
    import copy
    import io

    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster_tools.parity import packed_batch, rel_err, tiny_batch, tiny_model

    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=4, use_cache=True)
    vocab = model.config.vocab_size
    batch = packed_batch(vocab, [24, 40]) if packed else tiny_batch(vocab, USE_PREAMBLE_SEQ)
    reference = copy.deepcopy(model)
    ref = reference(**batch, use_cache=False)
    namespace = {"__name__": "readme", "model": model, "batch": batch}
    init = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None    # torchrun's process group is already up
    out = io.StringIO()
    try:
        for line, source in blocks:
            with contextlib.redirect_stdout(out):
                exec(compile(source, f"README.md:{line}", "exec"), namespace)
    finally:
        dist.init_process_group = init
        rm.unwire(model)
        rm.teardown()
    loss = namespace["out"].loss.detach().clone()
    dist.all_reduce(loss)
    return {"logits_err": rel_err(namespace["logits"], ref.logits),
            "loss_err": abs(loss.item() / dist.get_world_size() - ref.loss.item()) / abs(ref.loss.item()),
            "printed": out.getvalue()}


def test_readme_python_runs_as_written(pool):
    """The Use snippet, as written, on the session's 4 gloo ranks: an unpacked row and a packed row (the README's
    comment: position_ids restarting per document; the reference without CP with use_cache=False), the gathered
    logits and the mean loss equal to the model's without CP."""
    from test_docs import python_blocks

    blocks = python_blocks(_read("README.md"))
    assert blocks and any("context_parallel_region" in source for _, source in blocks), blocks
    for packed in (False, True):
        for r in pool.run(run_readme_python, blocks, packed):
            assert r["logits_err"] < 1e-5 and r["loss_err"] < 1e-5, (packed, r)
            assert "ringmaster wired family=llama" in r["printed"], r["printed"]


def test_api_doc_lists_every_config_field_and_gather_sequence_argument():
    """docs/api.md documents every RingmasterConfig field (its signature block and a table row each: issue 39 found
    documents_threshold missing), every LoadBalance value (``"documents"``), and gather_sequence's arguments as the
    function has them (``runtime=``, ``assignment=``)."""
    import dataclasses
    import inspect

    import ringmaster as rm

    api = _read("docs", "api.md")
    block = re.search(r"^RingmasterConfig\((.*?)\)\s*$", api, re.MULTILINE | re.DOTALL).group(1)
    fields = [f.name for f in dataclasses.fields(rm.RingmasterConfig) if not f.name.startswith("_")]
    for name in fields:
        assert re.search(rf"\b{name}=", block), f"RingmasterConfig({name}=...) missing from docs/api.md"
        assert re.search(rf"^\| `{name}`|^\| [^|]*`{name}`", api, re.MULTILINE), f"no table row for {name}"
    for value in rm.LoadBalance:
        assert f'load_balance="{value.value}"' in api or f"`{value.name}`" in api, value
    header = re.search(r"^### `rm\.gather_sequence\((.*?)\)", api, re.MULTILINE).group(1)
    documented = [p.split("=")[0].strip() for p in header.split(",")]
    assert documented == list(inspect.signature(rm.gather_sequence).parameters), documented
    assert "assignment=shard[\"ringmaster_batch\"].assignment" in api
    readme = _read("README.md")
    assert "position_ids restarting at 0" in readme and "use_cache=False" in readme   # what a packed row needs
