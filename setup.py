"""Install the framework and build its C++ dataset helpers (pybind11).

The helpers also build on first use from a plain checkout (see megatron/core/data/helpers.py), so
running with PYTHONPATH=<checkout> works where this was never installed.
"""
import os

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError as exc:  # pyproject.toml lists pybind11 as a build requirement
    raise SystemExit("setup.py needs pybind11 to build megatron/core/data/helpers.cpp: pip install pybind11") from exc

HERE = os.path.dirname(os.path.abspath(__file__))


def read_requirements():
    with open(os.path.join(HERE, "requirements.txt")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


helpers = Pybind11Extension(
    "megatron.core.data._helpers",
    ["megatron/core/data/helpers.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(
    name="megatron-deepspeed-3d",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT pretraining on DeepSpeed",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=read_requirements(),
    extras_require={
        # wandb: the logging test reads its offline run files, whose record format this range has
        "test": ["pytest>=7", "transformers>=4.40", "nltk>=3.8", "matplotlib>=3.7", "wandb>=0.31,<0.32",
                 "sentencepiece>=0.1.99"],
        "hf": ["transformers>=4.40"],
        "sentencepiece": ["sentencepiece>=0.1.99"],
        "sentences": ["nltk>=3.8"],
        "triton": ["triton"],
        "bnb": ["bitsandbytes>=0.45"],
        "plot": ["matplotlib>=3.7"],
        "eval": ["lm-eval>=0.4.13", "accelerate>=0.26"],
        "wandb": ["wandb"],
    },
    ext_modules=[helpers],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
