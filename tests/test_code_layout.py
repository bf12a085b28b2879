"""Structural rules of the codebase (docs/architecture.md: layering and size budgets), checked on the source tree."""
import ast
import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(REPO_ROOT, "megatron", "core")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 60
# Functions allowed past the budget, each with the reason it stays whole.
LONG_FUNCTION_EXCEPTIONS = {}


def python_files(*roots):
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "_build", "__pycache__"))]
            for name in filenames:
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.mark.parametrize("path", sorted(python_files(CORE)), ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_core_never_imports_training_or_argparse(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    bad = [m for m in imported_modules(tree) if m.startswith("megatron.training") or m == "argparse"]
    assert not bad, f"{os.path.relpath(path, REPO_ROOT)} imports {bad}: megatron.core must not read the trainer's arguments"


def source_files():
    roots = [os.path.join(REPO_ROOT, d) for d in ("megatron", "tools")]
    return sorted(python_files(*roots))


@pytest.mark.parametrize("path", source_files(), ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_size_budgets(path):
    with open(path) as f:
        text = f.read()
    rel = os.path.relpath(path, REPO_ROOT)
    assert text.count("\n") <= MAX_FILE_LINES, f"{rel} has more than {MAX_FILE_LINES} lines: split it"
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            name = f"{rel}::{node.name}"
            if length > MAX_FUNCTION_LINES and name not in LONG_FUNCTION_EXCEPTIONS:
                pytest.fail(f"{name} is {length} lines (budget {MAX_FUNCTION_LINES}): split it")
