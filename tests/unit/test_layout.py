"""The layout of serve_app: imports point one way, down the layers, every file stays readable and
says where it runs.

Each top-level folder (or module) of ``serve_app`` sits on a layer (docs/architecture.md): a
module imports only from its own folder or from a lower layer, never from a sibling on its own
layer (the front door and the engine meet only in ``deployments/model_server.py``), and the
modules of one folder import each other without a circle. Lazy imports and imports made only
for type checking count: a circle a type checker needs is still a circle a reader walks.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "serve_app"
LAYERS: list[set[str]] = [  # bottom first
    {"errors", "serve_internals", "vllm_internals"},
    {"protocol"},
    {"observability", "glm4"},
    {"config"},
    {"routing", "simulated_engine"},
    {"engine", "front_door"},
    {"deployments", "ops"},
    {"app"},
]
GENERATED = {"generation_pb2.py", "generation_pb2_grpc.py"}
MAX_LINES = 400
# How a module's docstring says which process runs it: "Runs in each model replica.", ...
RUNS_IN = re.compile(r"\bRuns in \S")


def layer_of(part: str) -> int:
    (layer,) = [i for i, names in enumerate(LAYERS) if part in names]
    return layer


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name in GENERATED:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports, wherever in the file (lazy and type-only included)."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in named if name in known and name.startswith("serve_app.")}


def top(module: str) -> str:
    """The top-level folder or module of ``serve_app`` that ``module`` is in."""
    return module.split(".")[1]


def test_every_top_level_part_of_the_package_has_a_layer() -> None:
    parts = {top(name) for name in modules() if name != "serve_app"}
    assert parts == set().union(*LAYERS)


def test_imports_point_down_the_layers_and_never_across_one() -> None:
    found = modules()
    wrong = []
    for name, path in found.items():
        if name == "serve_app":
            continue
        for target in imports_of(path, set(found)):
            if target == "serve_app" or top(target) == top(name):
                continue
            if layer_of(top(target)) >= layer_of(top(name)):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports that run back up or across a layer:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_itself_back_through_others() -> None:
    found = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in found.items():
        graph[name] = {t for t in imports_of(path, set(found)) if t != name and not name.startswith(t + ".")}
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, route = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*route, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*route, nxt]))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles)))


def test_every_file_is_one_a_reader_holds_in_one_sitting() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_every_modules_docstring_says_which_process_runs_it() -> None:
    """A reader learns where code runs from the module itself, not only from the folder's table
    (docs/architecture.md): every module's docstring has its "Runs in ..." sentence."""
    silent = sorted(
        str(path.relative_to(PACKAGE.parent))
        for path in modules().values()
        if not RUNS_IN.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    )
    assert not silent, "modules whose docstring does not say where they run:\n" + "\n".join(silent)


# Words the glossary retired (docs/architecture.md, "Words"): a whole answer is no "reply", and what
# the answer log holds is "stored", never "kept". Matched as parts of identifiers (snake or camel case).
RETIRED_WORDS = frozenset({"reply", "replies", "kept", "keep", "keeps", "keeping"})


def identifier_words(name: str) -> set[str]:
    return {part for part in re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower().split("_") if part}


def names_in(tree: ast.AST) -> set[str]:
    """Every name a module defines or reads: variables, attributes, functions, classes, arguments, keywords."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
    return found


def test_no_identifier_uses_a_word_the_glossary_retired() -> None:
    wrong = sorted(
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in modules().values()
        for name in names_in(ast.parse(path.read_text()))
        if identifier_words(name) & RETIRED_WORDS
    )
    assert not wrong, "identifiers with a retired word (docs/architecture.md, Words):\n" + "\n".join(wrong)


def test_the_retired_words_are_found_in_both_cases() -> None:
    assert identifier_words("kept_answers") & RETIRED_WORDS and identifier_words("KeptGauges") & RETIRED_WORDS
    assert not identifier_words("bookkeeping") & RETIRED_WORDS and not identifier_words("WholeAnswer") & RETIRED_WORDS
