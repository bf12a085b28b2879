"""The compiled index helpers (`helpers.cpp`, pybind11 module `_helpers`): loading and building.

``load_helpers()`` returns the module. It first imports the extension that ``setup.py`` installs
as ``megatron.core.data._helpers``; failing that (a plain checkout on ``PYTHONPATH``) it builds
``helpers.cpp`` on first use into ``megatron/core/data/_build/<python tag>/<source hash>/`` with
the system C++ compiler and pybind11's headers. Concurrent processes (ranks, DataLoader workers,
several jobs on one checkout) build once: one holds ``filelock.FileLock`` on ``build.lock`` while
compiling, the others wait for it and then load the library it wrote. The operating system drops
the lock of a process that dies (``flock``), so a crashed build never hangs later runs, and the
wait is bounded.
"""
import hashlib
import importlib
import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig

import filelock

MODULE_NAME = "megatron.core.data._helpers"
HELPERS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.cpp")
DEFAULT_BUILD_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build")
COMPILER_CANDIDATES = ("c++", "g++", "clang++")

_loaded_module = None


class HelpersBuildError(RuntimeError):
    """The helpers could not be found, compiled or loaded; the message says what to do."""


def load_helpers():
    """Return the `_helpers` module: the installed extension, else one built on first use."""
    global _loaded_module
    if _loaded_module is None:
        try:
            _loaded_module = importlib.import_module(MODULE_NAME)
        except ImportError:
            _loaded_module = build_on_first_use(DEFAULT_BUILD_ROOT)
    return _loaded_module


def extension_filename():
    """File name of the compiled module for this interpreter, e.g. `_helpers.cpython-311-...so`."""
    return "_helpers" + sysconfig.get_config_var("EXT_SUFFIX")


def python_tag():
    """ABI tag of this interpreter (EXT_SUFFIX without dots), e.g. `cpython-311-x86_64-linux-gnu`."""
    return sysconfig.get_config_var("EXT_SUFFIX").strip(".").rsplit(".", 1)[0]


def source_digest():
    """Short hash of helpers.cpp, so an edited source never loads a stale build."""
    with open(HELPERS_SOURCE, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def find_cxx_compiler():
    """The compiler command: `$CXX` if set, else the first of c++, g++, clang++ on PATH."""
    from_env = os.environ.get("CXX", "").strip()
    if from_env:
        command = shlex.split(from_env)
        if shutil.which(command[0]) is None:
            raise HelpersBuildError(
                f"CXX={from_env!r} is not an executable C++ compiler; fix or unset CXX to build "
                f"the data helpers ({HELPERS_SOURCE})")
        return command
    for name in COMPILER_CANDIDATES:
        path = shutil.which(name)
        if path is not None:
            return [path]
    raise HelpersBuildError(
        f"no C++ compiler found (looked for $CXX and {', '.join(COMPILER_CANDIDATES)} on PATH) to "
        f"build the data helpers {HELPERS_SOURCE}; install one (e.g. `apt-get install g++`) or "
        f"install the package with `pip install .`, which builds them at install time")


def _include_dirs():
    try:
        import pybind11
    except ImportError as exc:
        raise HelpersBuildError(
            "pybind11 is needed to build the data helpers: `pip install pybind11`") from exc
    paths = sysconfig.get_paths()
    python_includes = list(dict.fromkeys([paths["include"], paths["platinclude"]]))
    if not any(os.path.exists(os.path.join(d, "Python.h")) for d in python_includes):
        raise HelpersBuildError(
            f"Python.h not found in {python_includes}; install the Python development headers "
            f"(e.g. `apt-get install python3-dev`) to build the data helpers")
    return [pybind11.get_include()] + python_includes


def build_helpers_extension(output_dir):
    """Compile helpers.cpp into `output_dir/_helpers<EXT_SUFFIX>` and return that path.

    The library is written under a temporary name and renamed, so a reader never loads a partial
    file. Raises HelpersBuildError (with the compiler's output) on failure.
    """
    os.makedirs(output_dir, exist_ok=True)
    target = os.path.join(output_dir, extension_filename())
    partial = f"{target}.tmp-{socket.gethostname()}-{os.getpid()}"
    command = find_cxx_compiler() + ["-O3", "-Wall", "-shared", "-std=c++17", "-fPIC"]
    command += [f"-I{d}" for d in _include_dirs()]
    command += [HELPERS_SOURCE, "-o", partial]
    if sys.platform == "darwin":
        command += ["-undefined", "dynamic_lookup"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise HelpersBuildError(
            f"compiling the data helpers failed (exit {result.returncode}): "
            f"{shlex.join(command)}\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    os.replace(partial, target)
    return target


def _import_from(path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def build_on_first_use(build_root, timeout_s=900.0):
    """Build (once, under a file lock) and import the helpers from `build_root/<tag>/<source hash>/`.

    The first process to take the lock compiles; the others wait at most `timeout_s` for it, then
    find the library there and load it without compiling.
    """
    build_dir = os.path.join(build_root, python_tag(), source_digest())
    target = os.path.join(build_dir, extension_filename())
    if not os.path.exists(target):
        try:
            os.makedirs(build_dir, exist_ok=True)
        except OSError as exc:
            raise HelpersBuildError(
                f"cannot create the helpers build directory {build_dir} ({exc}); install the "
                f"package with `pip install .` to build the helpers at install time") from exc
        lock_path = os.path.join(build_dir, "build.lock")
        try:
            with filelock.FileLock(lock_path, timeout=timeout_s):
                if not os.path.exists(target):
                    build_helpers_extension(build_dir)
        except filelock.Timeout as exc:
            raise HelpersBuildError(
                f"timed out after {timeout_s:g} s waiting for the lock {lock_path}, held by another "
                f"process building the data helpers") from exc
    return _import_from(target)
