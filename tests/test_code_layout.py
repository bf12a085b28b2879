"""Structural rules of the codebase (docs/architecture.md: layering and size budgets), checked on the source tree.

- layering: megatron.core <- megatron.training <- tools/ and pretrain_gpt.py; core reads no argparse;
  nothing under megatron/ imports tools/, pretrain_gpt or the tests; only megatron/training/engine/
  imports deepspeed; no table of parameter names says how parameters are split;
- no import circle between the modules of megatron/ (imports inside functions count too: a lazy
  import that closes a circle only hides it);
- size budgets: files and functions;
- no block of code written twice: DUPLICATE_WINDOW significant lines (blank lines, comments, imports
  and lone brackets skipped, white space stripped) may not stand in two places of megatron/, tools/
  and pretrain_gpt.py.
"""
import ast
import collections
import os
import re

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


def module_name(path: str) -> str:
    """megatron/core/models/gpt/__init__.py -> megatron.core.models.gpt."""
    name = os.path.relpath(path, REPO_ROOT)[:-len(".py")].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def imported_names(tree, module: str, is_package: bool):
    """Every dotted name an import statement of ``module`` names (``from a import b`` gives a.b);
    relative imports resolved against ``module``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            yield from (f"{base}.{alias.name}" for alias in node.names)


def megatron_import_graph() -> dict[str, set[str]]:
    """module -> the modules of megatron/ it imports (a name resolves to its longest module prefix)."""
    paths = {module_name(path): path for path in python_files(os.path.join(REPO_ROOT, "megatron"))}

    def resolve(name):
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in paths.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        names = imported_names(tree, module, path.endswith("__init__.py"))
        graph[module] = {target for target in map(resolve, names) if target and target != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_import_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_megatron():
    circles = import_circles(megatron_import_graph())
    assert not circles, "import circles (move what both sides need into a module of its own): " + \
        "; ".join(" <-> ".join(circle) for circle in circles)


def test_megatron_never_imports_tools_the_entry_point_or_tests():
    upward = {"tools", "pretrain_gpt", "tests"}
    bad = []
    for path in python_files(os.path.join(REPO_ROOT, "megatron")):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        names = imported_names(tree, module_name(path), path.endswith("__init__.py"))
        bad += [f"{os.path.relpath(path, REPO_ROOT)} imports {name}" for name in names
                if name.split(".")[0] in upward]
    assert not bad, "megatron/ is imported by tools/ and pretrain_gpt.py, never the reverse: " + "; ".join(bad)


@pytest.mark.parametrize("path", sorted(python_files(CORE)), ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_core_never_imports_training_or_argparse(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    bad = [m for m in imported_modules(tree) if m.startswith("megatron.training") or m == "argparse"]
    assert not bad, f"{os.path.relpath(path, REPO_ROOT)} imports {bad}: megatron.core must not read the trainer's arguments"


ENGINE_PACKAGE = os.path.join(REPO_ROOT, "megatron", "training", "engine")


def deepspeed_imports(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return [m for m in imported_modules(tree) if m.split(".")[0] == "deepspeed"]


def test_deepspeed_is_imported_by_the_engine_package_only():
    """DeepSpeed behind one door: megatron/training/engine/ imports it, nothing else of megatron/,
    tools/ or pretrain_gpt.py does (a tool needing DeepSpeed goes through the engine package)."""
    paths = sorted(python_files(os.path.join(REPO_ROOT, "megatron"), os.path.join(REPO_ROOT, "tools")))
    paths.append(os.path.join(REPO_ROOT, "pretrain_gpt.py"))
    bad = [f"{os.path.relpath(path, REPO_ROOT)} imports {', '.join(deepspeed_imports(path))}" for path in paths
           if not path.startswith(ENGINE_PACKAGE + os.sep) and deepspeed_imports(path)]
    assert not bad, "only megatron/training/engine/ may import deepspeed: " + "; ".join(bad)


def test_a_deepspeed_import_is_found(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from deepspeed.runtime.utils import partition_uniform\n")
    (tmp_path / "b.py").write_text("import deepspeed_like\nimport torch\n")
    assert deepspeed_imports(str(tmp_path / "a.py")) == ["deepspeed.runtime.utils"]
    assert deepspeed_imports(str(tmp_path / "b.py")) == []


PARAMETER_NAME = re.compile(r"^[\w.]*\.?(weight|bias)$")
SHARDING_WORDS = re.compile(r"parallel|partition|split|stride|shard", re.IGNORECASE)


def is_split_value(node) -> bool:
    """A split dimension (an int or None), a tuple of them, or a constructed split (``TensorSplit(0)``)."""
    if isinstance(node, ast.Constant):
        return node.value is None or isinstance(node.value, int)
    if isinstance(node, ast.Tuple):
        return all(map(is_split_value, node.elts))
    return isinstance(node, ast.Call) and bool(SHARDING_WORDS.search(getattr(node.func, "id", "")))


def sharding_tables(source: str) -> list[str]:
    """Module-level names bound to a literal table of parameter names that says how they are split:
    a dict keyed by parameter names, or a tuple/list/set of them under a name about splitting."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [target.id for target in targets if isinstance(target, ast.Name)]
        value = node.value
        entries = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
        parameter_names = [entry for entry in entries if isinstance(entry, ast.Constant)
                           and isinstance(entry.value, str) and PARAMETER_NAME.match(entry.value)]
        about_splitting = isinstance(value, ast.Dict) and all(map(is_split_value, value.values))
        about_splitting = about_splitting or any(SHARDING_WORDS.search(name) for name in names)
        if parameter_names and about_splitting:
            found += names
    return found


def test_sharding_tables_are_found():
    assert sharding_tables('ROW_PARALLEL = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")\n') == \
        ["ROW_PARALLEL"]
    assert sharding_tables('PARTITION_DIM = {"mlp.dense_h_to_4h.weight": 0, "word_embeddings.weight": 0}\n') == \
        ["PARTITION_DIM"]
    assert sharding_tables('SPLITS = {"mlp.dense_h_to_4h.weight": TensorSplit(0, stride=2)}\n') == ["SPLITS"]
    assert sharding_tables('DIMS = {"self_attention.dense.weight": (1, None)}\n') == ["DIMS"]
    assert sharding_tables('RENAMED = {"transformer.wte.weight": "word_embeddings.weight"}\n') == []


def test_no_table_says_how_parameters_are_split():
    """How a parameter is split across TP ranks comes from its own ``partition_dim`` /
    ``partition_stride`` attributes (set by the parallel layers): adding a parameter needs no table."""
    bad = []
    for path in source_files():
        with open(path) as f:
            bad += [f"{os.path.relpath(path, REPO_ROOT)}: {name}" for name in sharding_tables(f.read())]
    assert not bad, "tables of parameter names that say how they are split: " + "; ".join(bad)


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


DUPLICATE_WINDOW = 8
_INSIGNIFICANT = re.compile(r"^(#.*|import .*|from \S+ import .*|[()\[\]{}:,]*)$")


def significant_lines(path: str) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that carry code (see the module docstring)."""
    with open(path) as f:
        numbered = [(number, line.strip()) for number, line in enumerate(f, start=1)]
    return [(number, text) for number, text in numbered if text and not _INSIGNIFICANT.match(text)]


def duplicate_blocks(paths: list[str], window: int = DUPLICATE_WINDOW) -> list[str]:
    """``a.py:10 ~ b.py:40`` for every run of ``window`` significant lines that stands twice (one row
    per pair of places, at the first line of the longest run)."""
    seen = collections.defaultdict(list)
    for path in paths:
        lines = significant_lines(path)
        for start in range(len(lines) - window + 1):
            key = tuple(text for _, text in lines[start:start + window])
            seen[key].append((os.path.relpath(path, REPO_ROOT), lines[start][0]))
    pairs = {}
    for places in seen.values():
        for first, second in zip(places, places[1:]):
            pairs.setdefault((first[0], second[0]), (first, second))  # the earliest window of a run
    return sorted(f"{a[0]}:{a[1]} ~ {b[0]}:{b[1]}" for a, b in pairs.values())


def test_duplicate_blocks_are_found(tmp_path):
    block = "\n".join(f"value_{i} = compute({i})" for i in range(DUPLICATE_WINDOW))
    (tmp_path / "a.py").write_text(f"import os\n{block}\n")
    (tmp_path / "b.py").write_text(f"x = 1\n\n# a comment\n{block}\n")
    (tmp_path / "c.py").write_text(block.replace("value_3", "other") + "\n")
    found = duplicate_blocks([str(tmp_path / name) for name in ("a.py", "b.py", "c.py")])
    assert len(found) == 1, found  # c.py differs in one line
    first, second = found[0].split(" ~ ")
    assert first.endswith("a.py:2") and second.endswith("b.py:4")


def test_no_block_of_code_written_twice():
    paths = sorted(python_files(os.path.join(REPO_ROOT, "megatron"), os.path.join(REPO_ROOT, "tools")))
    paths.append(os.path.join(REPO_ROOT, "pretrain_gpt.py"))
    found = duplicate_blocks(paths)
    assert not found, f"blocks of {DUPLICATE_WINDOW} lines written twice (make one serve both): " + "; ".join(found)
