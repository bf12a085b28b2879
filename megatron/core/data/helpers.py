"""The compiled index helpers (`helpers.cpp`, pybind11 module `_helpers`): loading and building.

``load_helpers()`` returns the module. It first imports the extension that ``setup.py`` installs
as ``megatron.core.data._helpers``; failing that (a plain checkout on ``PYTHONPATH``) it builds
``helpers.cpp`` on first use into ``megatron/core/data/_build/<python tag>/<source hash>/`` with
the system C++ compiler and pybind11's headers. Concurrent processes (ranks, DataLoader workers,
several jobs on one checkout) build once: one holds a lock file while compiling, the others wait
for the library to appear. The wait is bounded, and a lock left behind by a dead process is
detected and removed, so a crashed build never hangs later runs.

This module imports only the standard library at import time, so ``setup.py`` can load it by
path and call ``build_helpers_extension(output_dir)``.
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
import time

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


def build_on_first_use(build_root, timeout_s=900.0, stale_after_s=600.0):
    """Build (once, under a lock) and import the helpers from `build_root/<tag>/<source hash>/`.

    Waits at most `timeout_s` for another process's build; a lock older than `stale_after_s`
    or owned by a dead process on this host is taken over.
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
        lock = BuildLock(os.path.join(build_dir, "build.lock"), timeout_s, stale_after_s)
        if lock.acquire(done=lambda: os.path.exists(target)):
            try:
                if not os.path.exists(target):
                    build_helpers_extension(build_dir)
            finally:
                lock.release()
    return _import_from(target)


class BuildLock:
    """An exclusive lock file created with O_CREAT | O_EXCL, holding "pid host time" of its owner.

    ``acquire(done)`` polls until it creates the file (returns True), ``done()`` becomes true
    (returns False: the work was finished by the owner), or `timeout_s` passes (raises).
    The lock is stale, and removed, when its owner is a dead process on this host or when it is
    older than `stale_after_s` (an owner on another host, or a reused pid).
    """

    def __init__(self, path, timeout_s, stale_after_s, poll_s=0.1):
        self.path = path
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.poll_s = poll_s
        self._owned = False

    def acquire(self, done=lambda: False):
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._try_create():
                return True
            if done():
                return False
            self._remove_if_stale()
            if time.monotonic() > deadline:
                raise HelpersBuildError(
                    f"timed out after {self.timeout_s:g} s waiting for the lock {self.path} "
                    f"(owner: {self._read_owner() or 'unknown'}); if no build is running, delete it")
            time.sleep(self.poll_s)

    def release(self):
        if self._owned:
            self._owned = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def _try_create(self):
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n")
        self._owned = True
        return True

    def _read_owner(self):
        try:
            with open(self.path) as f:
                return f.read().strip()
        except FileNotFoundError:
            return ""

    def _remove_if_stale(self):
        owner = self._read_owner()
        try:
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return
        if age > self.stale_after_s or _owner_is_dead(owner):
            # Remove only the lock we judged; a fresh one created meanwhile stays.
            if self._read_owner() == owner:
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass


def _owner_is_dead(owner):
    fields = owner.split()
    if len(fields) < 2 or fields[1] != socket.gethostname() or not fields[0].isdigit():
        return False
    try:
        os.kill(int(fields[0]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
