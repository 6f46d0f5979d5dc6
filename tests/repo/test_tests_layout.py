"""The tests are laid out like the code and by kind, and share helpers, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "serve_app"


def test_no_test_module_imports_another() -> None:
    """A helper two test modules need lives in a helper module, not in one of them."""
    wrong = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            wrong += [f"{path.relative_to(TESTS)} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not wrong, "\n".join(wrong)


def test_the_unit_tests_have_a_folder_for_each_folder_of_the_package_and_no_other() -> None:
    unit = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    package = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert unit <= package, unit - package
    missing = {name for name in package - unit if any((PACKAGE / name).rglob("*.py"))}
    assert not missing, f"folders of serve_app without unit tests: {missing}"
