"""What ``pip install .`` alone brings is enough for the trainer and the tools (pretraining,
preprocessing, checkpoint conversion, generation and its server).

Every third-party module imported anywhere in pretrain_gpt.py, megatron/, tools/*.py and
tools/convert_checkpoint/ must be a distribution of requirements.txt or one of their own
dependencies (as installed here), or its import must be guarded: inside ``try`` / ``except
ImportError`` (or a broader handler), or checked with ``importlib.util.find_spec("name")``. A guard
that stops the run (raises or exits) must say what to install ("pip install ..."), directly or through
a module constant; one that falls back to another path needs no message. The evaluation harness
(tasks/, the ``eval`` extra) and the benchmarks (tools/benchmarks/, development tools) are outside
this promise.
"""
import ast
import importlib.metadata
import os
import re
import sys

from packaging.requirements import Requirement

from tests.conftest import REPO_ROOT

FIRST_PARTY = {"megatron", "tools", "tasks", "tests", "preprocess_data"}
# Loaded only through megatron/core/fused_kernels/selection.py where the module exists (torch's CUDA builds bring it).
OPTIONAL_BY_DESIGN = {"triton"}
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_distributions() -> set[str]:
    """requirements.txt's distributions and, recursively, the ones they require (no extras)."""
    with open(os.path.join(REPO_ROOT, "requirements.txt")) as f:
        pending = [Requirement(line).name for line in map(str.strip, f) if line and not line.startswith("#")]
    found: set[str] = set()
    while pending:
        name = canonical(pending.pop())
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def scanned_files() -> list[str]:
    files = [os.path.join(REPO_ROOT, "pretrain_gpt.py")]
    for top in ("megatron", "tools"):
        for directory, subdirectories, names in os.walk(os.path.join(REPO_ROOT, top)):
            subdirectories[:] = [d for d in subdirectories if d not in ("benchmarks", "__pycache__")]
            files += [os.path.join(directory, name) for name in names if name.endswith(".py")]
    return sorted(files)


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "text" assignments."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            constants.update({target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)})
    return constants


def says_what_to_install(nodes, constants: dict[str, str]) -> bool:
    """True when ``nodes`` do not stop the run, or their message names a pip install."""
    walked = [child for node in nodes for child in ast.walk(node)]
    stops = any(isinstance(child, ast.Raise) or (isinstance(child, ast.Call) and "exit" in ast.unparse(child.func))
                for child in walked)
    texts = [child.value for child in walked if isinstance(child, ast.Constant) and isinstance(child.value, str)]
    texts += [constants[child.id] for child in walked if isinstance(child, ast.Name) and child.id in constants]
    return not stops or any("pip install" in text for text in texts)


def import_guard(parents: list[ast.AST], constants: dict[str, str]) -> str | None:
    """None when an enclosing try catches the ImportError and says what to install; else the problem."""
    for parent in parents:
        if not isinstance(parent, ast.Try):
            continue
        for handler in parent.handlers:
            types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            if {getattr(t, "id", None) for t in types} & IMPORT_ERRORS:
                return None if says_what_to_install(handler.body, constants) else "its handler names no pip install"
    return "it is not guarded"


def find_spec_checks(trees: dict[str, ast.Module]) -> dict[str, bool]:
    """Module name -> whether some ``if ... find_spec("name") ...`` check says what to install."""
    checked: dict[str, bool] = {}
    for tree in trees.values():
        constants = string_constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.If):
                continue
            for call in ast.walk(node.test):
                if (isinstance(call, ast.Call) and ast.unparse(call.func).endswith("find_spec") and call.args
                        and isinstance(call.args[0], ast.Constant)):
                    name = call.args[0].value.split(".")[0]
                    checked[name] = checked.get(name, False) or says_what_to_install(node.body, constants)
    return checked


def imports(tree: ast.Module):
    """(line, top-level module, enclosing nodes) of every absolute import, at any depth."""
    stack = [(tree, [])]
    while stack:
        node, parents = stack.pop()
        stack += [(child, parents + [node]) for child in ast.iter_child_nodes(node)]
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[0], parents) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module.split(".")[0], parents


def test_every_third_party_import_is_a_base_requirement_or_guarded():
    base = base_distributions()
    distributions = importlib.metadata.packages_distributions()
    trees = {}
    for path in scanned_files():
        with open(path) as f:
            trees[path] = ast.parse(f.read(), path)
    checked = find_spec_checks(trees)
    problems = []
    for path, tree in trees.items():
        constants = string_constants(tree)
        for line, module, parents in imports(tree):
            if module in sys.stdlib_module_names or module in FIRST_PARTY or module in OPTIONAL_BY_DESIGN:
                continue
            if any(canonical(d) in base for d in distributions.get(module, [])):
                continue
            problem = import_guard(parents, constants)
            if problem and checked.get(module):
                continue
            if problem:
                problems.append(f"{os.path.relpath(path, REPO_ROOT)}:{line} imports {module}, which is not in "
                                f"requirements.txt (nor required by it), and {problem}")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_imports_it_judges():
    """The checks above are not vacuous: the server's flask and the export's safetensors are base
    requirements, and the sentence splitter's nltk is guarded with an install hint."""
    base = base_distributions()
    assert {"flask", "werkzeug", "safetensors", "deepspeed", "torch"} <= base
    assert "transformers" not in base and "nltk" not in base
    tree = ast.parse(open(os.path.join(REPO_ROOT, "megatron", "core", "data", "preprocessing.py")).read())
    nltk = [parents for _, module, parents in imports(tree) if module == "nltk"]
    assert nltk and import_guard(nltk[0], string_constants(tree)) is None
    unguarded = ast.parse("def f():\n    try:\n        import x\n    except ImportError:\n        raise SystemExit('no')\n")
    _, _, parents = next(imports(unguarded))
    assert import_guard(parents, {}) == "its handler names no pip install"
