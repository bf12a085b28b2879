"""How a parameter is split over tensor-parallel ranks is read from the parameter's own attributes
(megatron.core.checkpoint.sharding), never from a table of parameter names: no module of megatron/
or tools/ holds a dict keyed by parameter names whose values are split dimensions, nor a collection
of parameter names under a name that says it lists a split."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
PARAMETER_NAME = re.compile(r"^(\w+\.)*\w+\.(weight|bias)$")
SPLIT_WORDS = re.compile(r"parallel|split|partition|stride|vocab|shard", re.IGNORECASE)
OLD_TABLES = '''
COLUMN_PARALLEL = ("self_attention.query_key_value.weight", "mlp.dense_h_to_4h.weight")
SPLIT_DIMS = {"self_attention.dense.weight": 1, "word_embeddings.weight": 0}
SPLITS = {"mlp.dense_h_to_4h.weight": TensorSplit(0, stride=2)}
'''


def _is_parameter_name(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(PARAMETER_NAME.match(node.value))


def _is_split_value(node) -> bool:
    """A split dimension (0, 1, None), a tuple of them, or a constructed split."""
    if isinstance(node, ast.Constant):
        return node.value is None or isinstance(node.value, int)
    if isinstance(node, ast.Tuple):
        return all(_is_split_value(element) for element in node.elts)
    return isinstance(node, ast.Call) and SPLIT_WORDS.search(ast.unparse(node.func)) is not None


def name_tables(source: str) -> list[str]:
    """The tables of ``source`` that say by parameter name how parameters are split (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            pairs = [(key, value) for key, value in zip(node.keys, node.values) if _is_parameter_name(key)]
            if pairs and all(_is_split_value(value) for _, value in pairs):
                found.append(f"line {node.lineno}: {{{pairs[0][0].value!r}: {ast.unparse(pairs[0][1])}, ...}}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
            names = [ast.unparse(target) for target in node.targets]
            if any(SPLIT_WORDS.search(name) for name in names) and any(map(_is_parameter_name, node.value.elts)):
                found.append(f"line {node.lineno}: {names[0]} lists parameter names")
    return found


def test_the_scan_finds_tables_of_parameter_names():
    assert len(name_tables(OLD_TABLES)) == 3
    assert name_tables('NAMES = {"word_embeddings.weight": "embedding.word_embeddings.weight"}') == []


@pytest.mark.parametrize("folder", ["megatron", "tools"])
def test_no_module_splits_parameters_by_a_table_of_their_names(folder):
    tables = [f"{path.relative_to(ROOT)} {table}" for path in sorted((ROOT / folder).rglob("*.py"))
              for table in name_tables(path.read_text())]
    assert tables == [], "read the split from the parameters (megatron.core.checkpoint.sharding):\n" + "\n".join(tables)
