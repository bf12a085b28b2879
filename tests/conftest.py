"""Shared pytest configuration: markers, the sample corpus, and CPU-only defaults."""
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_CORPUS = os.path.join(REPO_ROOT, "examples", "data", "python-docs.jsonl.gz")

# Session fixtures shared by many modules, registered once so they are built once per session.
# Each before the modules that import it (pytest rewrites a plugin's asserts only if it imports it first).
pytest_plugins = ["tests.fixtures_tokenizer", "tests.training.e2e_utils", "tests.training.pretrain_helpers",
                  "tests.training.parallel_3d_runs", "tests.tasks.trained_checkpoint"]

if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Before any test imports DeepSpeed: JIT-built ops go where this environment's runs find them.
from megatron.training.initialize import use_environment_extensions_dir  # noqa: E402

use_environment_extensions_dir()


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def sample_corpus():
    """Path of the embedded jsonl.gz corpus (Python's documentation, PSF license)."""
    return SAMPLE_CORPUS
