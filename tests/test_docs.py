"""The docs name what exists: module paths, names in modules, links and their anchors.

After a module moves or a function is renamed, the docs, docstrings and comments that still
name the old place fail here, each with its file and line. Read with ``ast`` and regexes
only: nothing is imported.
"""

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_jax"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [
    *DOCS,
    *sorted((ROOT / "benchmarks").glob("*.md")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
    *sorted(PACKAGE.rglob("*.py")),
    *sorted((ROOT / "configs").glob("*.py")),
    *sorted((ROOT / "dev").glob("*.py")),
]
# grpo_jax.x.y (a module, then names inside it), not inside a longer dotted or path word.
DOTTED = re.compile(r"(?<![\w./-])grpo_jax(?:\.[A-Za-z_]\w*)+")
# grpo_jax/x/y.py or grpo_jax/x/ (a link's ../ prefix allowed), not inside another path.
PATH = re.compile(r"(?<![\w./-])(?:\.\./)?grpo_jax/[\w./]*")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def _names(module: pathlib.Path) -> dict:
    """The names a module defines at its top level: {name: the names inside a class, or None}.

    A name it imports counts when the module re-exports it: a package's ``__init__``, or a
    module whose ``__all__`` lists it. A name a module merely imports (``setup`` uses
    ``builders.tokenizer_sampling``) is not that module's to cite.
    """
    tree = ast.parse(module.read_text())
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    reexports = module.name == "__init__.py"

    def scope(body) -> dict:
        out = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = None
            elif isinstance(node, ast.ClassDef):
                out[node.name] = scope(node.body)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update(
                    {n.id: None for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                )
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    name = (alias.asname or alias.name).split(".")[0]
                    if reexports or name in exported:
                        out[name] = None
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for part in (
                    node.body,
                    getattr(node, "orelse", []),
                    getattr(node, "finalbody", []),
                ):
                    out.update(scope(part))
                for handler in getattr(node, "handlers", []):
                    out.update(scope(handler.body))
        return out

    return scope(tree.body)


def resolves(dotted: str) -> bool:
    """Whether ``grpo_jax.a.b.c`` is a module, or names defined in one (a class's too)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py")
        if not module.is_file():
            module = base / "__init__.py"
        if module.is_file():
            break
    else:
        return False
    scope = _names(module)
    for name in parts[i:]:
        if scope is None or name.startswith("__"):  # a function's or value's attribute
            return True
        if name not in scope:
            return False
        scope = scope[name]
    return True


def _stale(path: pathlib.Path) -> list[str]:
    found = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        for match in DOTTED.finditer(line):
            if not resolves(match.group(0)):
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {match.group(0)}")
        for match in PATH.finditer(line):
            target = match.group(0).removeprefix("../").rstrip(".")
            if target.count("/") == 1 and not target.endswith(".py"):
                continue  # "grpo_jax/trl" is a ratio of two systems, not a path
            if not (ROOT / target).exists():
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {target}")
    return found


def test_every_module_path_and_name_the_docs_cite_exists():
    stale = [line for path in SOURCES for line in _stale(path)]
    assert not stale, "names of modules or functions that no longer exist:\n" + "\n".join(stale)


def test_the_checker_finds_a_moved_module_and_a_renamed_function():
    assert resolves("grpo_jax.run.builders.tokenizer_sampling")
    assert resolves("grpo_jax.rollout.sources.RolloutSource.take")
    assert not resolves("grpo_jax.run.setup.tokenizer_sampling")  # moved to run.builders
    assert not resolves("grpo_jax.objective.logprobs.completion_scores")  # renamed
    assert not resolves("grpo_jax.data.preference")  # split in three


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            out.add(slug.replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_leads_somewhere(page):
    broken = []
    for lineno, line in enumerate(page.read_text().splitlines(), 1):
        for match in LINK.finditer(line):
            target, _, anchor = match.group(1).partition("#")
            if "://" in target or target.startswith("mailto:"):
                continue
            dest = (page.parent / target) if target else page
            if not dest.exists():
                broken.append(f"{lineno}: {match.group(1)} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{lineno}: {match.group(1)} (no such heading)")
    assert not broken, f"{page.name}:\n" + "\n".join(broken)


def test_the_module_tour_names_every_module():
    """docs/architecture.md's module tour names each module, or a folder that holds it."""
    tour = (ROOT / "docs" / "architecture.md").read_text().split("\n## Module tour\n", 1)[1]
    named = set(re.findall(r"grpo_jax/[\w/]+(?:\.py|/)", tour.split("\n## ", 1)[0]))
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "__init__.py"
        and str(p.relative_to(ROOT)) not in named
        and not any(f"{d.relative_to(ROOT)}/" in named for d in p.parents if PACKAGE in d.parents)
    ]
    assert not missing, "modules the tour does not name: " + ", ".join(missing)
