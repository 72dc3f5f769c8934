"""The layout rules of ARCHITECTURE.md, checked on the source: which package may import which,
which third-party libraries stay out of which package, no import cycle, no module over 400 lines.

Imports are read with `ast`, module-level and function-level alike, from every first-party
module outside tests/ and bench/. A subprocess then imports the light packages for real and
names whoever loaded a library they must not load."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache

import pytest

from tests.helpers import REPO

ANYTHING = None
# package -> the first-party packages it may import (besides itself)
MAY_IMPORT: dict[str, set[str] | None] = {
    "settings": set(),  # every environment variable, read here only; any package may import it
    "pagedbatch_kernels": {"settings"},
    "engine": {"pagedbatch_kernels", "settings"},
    "batchfile": {"engine", "settings"},  # only engine modules that load no torch, checked below
    "store": {"batchfile", "settings"},
    "broker": {"store", "settings"},
    "api": {"store", "batchfile", "broker", "settings"},
    "workers": {"engine", "store", "batchfile", "broker", "settings"},
    "migrations": {"store", "settings"},
    "pagedbatch": ANYTHING,
    "examples": ANYTHING,
}
GPU = {"torch", "triton"}
WEB = {"flask", "werkzeug", "gunicorn"}
QUEUE = {"celery", "kombu", "redis"}
DATABASE = {"sqlalchemy", "alembic", "psycopg"}
# package -> third-party libraries it must not import
MUST_NOT_IMPORT: dict[str, set[str]] = {
    "settings": GPU | WEB | QUEUE | DATABASE | {"transformers"},
    "pagedbatch_kernels": WEB | QUEUE | DATABASE | {"transformers"},
    "engine": WEB | QUEUE | DATABASE,
    "batchfile": GPU | WEB | QUEUE | DATABASE,
    "store": GPU | WEB | QUEUE,
    "broker": GPU | WEB,
    "api": GPU | {"celery", "kombu"},  # the API enqueues through broker, never Celery directly
    "workers": WEB,
    "migrations": GPU | WEB | QUEUE,
}
MAX_LINES = 400
MAX_MODULES_PER_FOLDER = 15
SKIPPED_DIRS = {"tests", "bench"}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # first-party module, or the root name of a third-party one
    first_party: bool
    line: int
    module_level: bool  # runs when `source` is imported (not inside a function or TYPE_CHECKING)

    def where(self) -> str:
        return f"{path_of(self.source)}:{self.line}"


@cache
def modules() -> dict[str, str]:
    """Dotted name -> path relative to the repository, for every first-party module."""
    found = {}
    for path in sorted(REPO.glob("*/**/*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in SKIPPED_DIRS or rel.parts[0].startswith(".") or ".venv" in rel.parts:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = str(rel)
    return found


def path_of(module: str) -> str:
    return modules()[module]


def package_of(module: str) -> str:
    return module.partition(".")[0]


def _resolve(name: str) -> str | None:
    """The longest prefix of `name` that is a first-party module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules():
            return ".".join(parts)
        parts.pop()
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str):
        self.module = module
        self.is_package = path_of(module).endswith("__init__.py")
        self.depth = 0  # functions and TYPE_CHECKING blocks entered
        self.found: list[Import] = []

    def _nested(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_If(self, node):
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            self._nested(node)
        else:
            self.generic_visit(node)

    def _add(self, name: str, line: int):
        target = _resolve(name)
        first_party = target is not None or package_of(name) in MAY_IMPORT
        self.found.append(Import(self.module, target or package_of(name), first_party, line, self.depth == 0))

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package.pop()
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if base else alias.name, node.lineno)


@cache
def imports() -> list[Import]:
    found = []
    for module, rel in modules().items():
        collector = _Collector(module)
        collector.visit(ast.parse((REPO / rel).read_text(), rel))
        found.extend(collector.found)
    return found


def edges(module_level_only: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for imp in imports():
        wanted = imp.module_level or not module_level_only
        if wanted and imp.first_party and imp.target in graph and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    return graph


def loads_on_import(module: str) -> dict[str, list[str]]:
    """Third-party root -> the chain of first-party modules through which importing `module`
    (which first imports its parent packages) loads it; module-level imports only."""
    graph = edges(module_level_only=True)
    third_party: dict[str, set[str]] = {}
    for imp in imports():
        if not imp.first_party and imp.module_level:
            third_party.setdefault(imp.source, set()).add(imp.target)
    chains = {m: [m] for m in [*_parents(module), module] if m in graph}
    queue = list(chains)
    found: dict[str, list[str]] = {}
    while queue:
        current = queue.pop(0)
        for lib in third_party.get(current, ()):
            found.setdefault(lib, chains[current])
        for nxt in [*graph[current], *(p for p in _parents(current) if p in graph)]:
            if nxt not in chains:
                chains[nxt] = [*chains[current], nxt]
                queue.append(nxt)
    return found


def _parents(module: str) -> list[str]:
    """The packages that Python imports before `module`: a.b.c -> [a, a.b]."""
    return [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]


def _report(title: str, problems: list[str]) -> str:
    return f"{title} ({len(problems)}):\n  " + "\n  ".join(sorted(problems))


def test_every_package_has_rules():
    unknown = sorted({package_of(m) for m in modules()} - set(MAY_IMPORT))
    assert not unknown, f"packages without layout rules in tests/test_layout.py: {unknown}"


def test_no_installed_distribution_claims_our_package_names():
    """A top-level name of ours that another distribution also installs shadows it, or is shadowed:
    transformers 5.25 began importing Hugging Face's `kernels`, and found our old `kernels/` instead."""
    import importlib.metadata

    claimed = importlib.metadata.packages_distributions()
    ours = {package_of(m) for m in modules()} - {"examples"}
    clashes = {name: claimed[name] for name in ours if set(claimed.get(name, [])) - {"pagedbatch"}}
    assert not clashes, f"top-level names also installed by other distributions: {clashes}"


def test_packages_import_only_what_they_may():
    problems = []
    for imp in imports():
        if not imp.first_party:
            continue
        source, target = package_of(imp.source), package_of(imp.target)
        allowed = MAY_IMPORT.get(source, ANYTHING)
        if source == target or allowed is ANYTHING:
            continue
        if target not in allowed:
            problems.append(
                f"{imp.where()} {imp.source} imports {imp.target}: {source} may import "
                f"{sorted(allowed) or 'no other first-party package'}"
            )
        elif source == "batchfile" and target == "engine":
            heavy = {lib: chain for lib, chain in loads_on_import(imp.target).items() if lib in GPU}
            for lib, chain in heavy.items():
                problems.append(
                    f"{imp.where()} {imp.source} imports {imp.target}, which loads {lib} "
                    f"(through {' -> '.join(chain)}); batchfile may use only engine's torch-free modules"
                )
    assert not problems, _report("imports across packages that the layout forbids", problems)


def test_packages_keep_out_heavy_libraries():
    problems = []
    for imp in imports():
        banned = MUST_NOT_IMPORT.get(package_of(imp.source), set())
        if not imp.first_party and imp.target in banned:
            problems.append(f"{imp.where()} {imp.source} imports {imp.target}")
    assert not problems, _report("third-party imports that the layout forbids", problems)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        current = queue.pop(0)
        for nxt in sorted(graph[current] & members):
            if nxt == start:
                return [*paths[current], start]
            if nxt not in paths:
                paths[nxt] = [*paths[current], nxt]
                queue.append(nxt)
    return component


def test_no_import_cycle():
    graph = edges()
    where = {(i.source, i.target): i.where() for i in imports() if i.first_party}
    problems = []
    for component in _cycles(graph):
        cycle = _one_cycle(graph, component)
        steps = ", ".join(f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:]))
        problems.append(f"{len(component)} modules {component}; for example {steps}")
    assert not problems, _report("import cycles, function-level imports included", problems)


def test_no_module_over_400_lines():
    sizes = {rel: len((REPO / rel).read_text().splitlines()) for rel in modules().values()}
    problems = [f"{rel}: {n} lines" for rel, n in sizes.items() if n > MAX_LINES]
    assert not problems, _report(f"modules over {MAX_LINES} lines", problems)


def test_no_folder_over_15_modules():
    """A room a reader can take in: every first-party package folder keeps at most 15 modules (__init__ counted)."""
    per_folder: dict[str, int] = {}
    for rel in modules().values():
        folder = rel.rpartition("/")[0]
        per_folder[folder] = per_folder.get(folder, 0) + 1
    assert {"engine", "workers", "store", "api", "pagedbatch"} <= set(per_folder), sorted(per_folder)
    problems = [f"{folder}/: {n} modules" for folder, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER]
    assert not problems, _report(f"folders over {MAX_MODULES_PER_FOLDER} modules", problems)


# ---- what an import really loads ----------------------------------------------------------------

WATCH = r"""
import importlib, json, sys, traceback
modules, banned, repo = sys.argv[1].split(","), set(sys.argv[2].split(",")), sys.argv[3]
loaded = {}

class Watch:  # records who first imports a banned package, then lets the import go on
    def find_spec(self, name, path=None, target=None):
        root = name.partition(".")[0]
        if root in banned and root not in loaded:
            loaded[root] = [f"{f.filename[len(repo) + 1:]}:{f.lineno}" for f in traceback.extract_stack()
                            if f.filename.startswith(repo) and "site-packages" not in f.filename]
        return None

sys.meta_path.insert(0, Watch())
for module in modules:
    importlib.import_module(module)
print(json.dumps(loaded))
"""


def _all_of(package: str) -> list[str]:
    return [m for m in modules() if package_of(m) == package and not m.startswith("migrations.versions")]


# modules imported together in a fresh interpreter -> what none of them may load
REAL_IMPORTS = {
    "batchfile": (lambda: _all_of("batchfile"), GPU | WEB | QUEUE | DATABASE),
    "store": (lambda: _all_of("store"), GPU | WEB | QUEUE),
    "broker": (lambda: _all_of("broker"), GPU | WEB),
    "api.app": (lambda: ["api.app"], GPU | {"workers", "pagedbatch_kernels"}),
}


@pytest.mark.parametrize("name", list(REAL_IMPORTS))
def test_importing_loads_nothing_it_must_not(name):
    """The static rules above miss what a third-party library imports in turn; this does not."""
    targets, banned = REAL_IMPORTS[name]
    targets = targets()
    done = subprocess.run(
        [sys.executable, "-c", WATCH, ",".join(targets), ",".join(sorted(banned)), str(REPO)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    problems = [f"{lib}, first imported through {' -> '.join(stack) or '?'}" for lib, stack in loaded.items()]
    assert not problems, _report(f"importing {name} ({len(targets)} modules) loads", problems)
