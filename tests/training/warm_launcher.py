"""Trainer processes forked from a warm interpreter: the tests' CPU runs of ``pretrain_gpt.py`` without the
seconds each new interpreter spends importing torch and DeepSpeed (about a thousand ranks per suite).

A server (``python -m tests.training.warm_launcher SOCKET``), started once per test session with the
children's CPU environment, imports torch, torch.distributed, torch's optimizers and torch._dynamo (which
their constructor imports) and DeepSpeed, then serves requests on a Unix socket, one connection per request:

    ("start", command, env, cwd, output)  -> pid   fork; the child leads a new session, writes stdout and
                                                   stderr to the file ``output`` (appending), takes ``env``,
                                                   ``cwd`` and sys.argv = command, and runs the script as
                                                   __main__; its exit status is the interpreter's would be
    ("poll", pid)                         -> status or None (running); -N: killed by signal N

The child ends as an interpreter does: non-daemon threads joined, atexit handlers run, streams flushed; an
uncaught exception prints its traceback and exits 1, a KeyboardInterrupt dies of SIGINT. Signals reach the
child directly (its pid leads its session: ``os.killpg``). The server reaps its children only when asked
about them, and exits when the test process that started it is gone.

``WarmProcess`` is the client's handle, with the part of ``subprocess.Popen``'s interface the tests use.
"""
import io
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time

from megatron.training.signals import run_exit_handlers

PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "deepspeed")
STARTUP_TIMEOUT = 120  # seconds for the server's imports, times MEGATRON_TEST_TIMEOUT_SCALE
_server = None  # (process, socket path) of this test session's server


def _send(connection: socket.socket, value) -> None:
    data = pickle.dumps(value)
    connection.sendall(struct.pack("!I", len(data)) + data)


def _receive(connection: socket.socket):
    header = _read_exactly(connection, 4)
    return pickle.loads(_read_exactly(connection, struct.unpack("!I", header)[0]))


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = connection.recv(size)
        if not chunk:
            raise ConnectionError("the warm launcher closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------- the server


def _run_child(command: list[str], env: dict, cwd: str, output: str) -> None:
    """In the forked child, a session leader already: become the script's interpreter, then exit with its
    status (never returns)."""
    descriptor = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    os.close(null)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the dispositions of a new interpreter
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for default in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(default, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    script = command[0]
    sys.argv = list(command)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.path[1:1] = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path and path not in sys.path]
    import torch

    threads = env.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    os._exit(_interpret(script))


def _interpret(script: str) -> int:
    """Run ``script`` as __main__ and finish as the interpreter would: its exit status."""
    import runpy
    import traceback

    status, interrupted = 0, False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_request:
        code = exit_request.code
        if code is None or isinstance(code, int):
            status = code or 0
        else:
            print(code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - the interpreter reports any uncaught exception the same way
        traceback.print_exc()
        status = 1
    run_exit_handlers()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def _reap(finished: dict) -> None:
    """Collect the exit status of every child that has ended."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        finished[pid] = -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def serve(path: str) -> None:
    """Import PRELOAD, then answer requests on the Unix socket ``path`` until the parent is gone."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    open(path + ".ready", "w").close()
    finished = {}
    while os.getppid() == parent:
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        with connection:
            connection.settimeout(None)
            request = _receive(connection)
            _reap(finished)
            if request[0] == "start":
                led, leading = os.pipe()
                pid = os.fork()
                if pid == 0:
                    try:
                        listener.close()
                        connection.close()
                        os.setsid()
                        os.write(leading, b"1")
                        os.close(leading)
                        os.close(led)
                        _run_child(*request[1:])
                    finally:
                        os._exit(70)  # _run_child failed before the script: never back into this loop
                os.close(leading)
                os.read(led, 1)  # the pid is answered once it leads its session: killpg reaches it at once
                os.close(led)
                finished.pop(pid, None)  # a status left by an earlier child of the same pid
                _send(connection, pid)
            else:
                pid = request[1]
                _send(connection, finished.pop(pid) if pid in finished else None)


# ---------------------------------------------------------------------------------------- the client


def _call(request):
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with connection:
        connection.connect(_server_path())
        _send(connection, request)
        return _receive(connection)


def _server_path() -> str:
    """The socket of this session's server, started on first use with ``server_env`` (the children's
    CPU environment), and stopped when the test process exits."""
    global _server
    if _server is None:
        import atexit
        import tempfile

        from tests.training.e2e_utils import REPO_ROOT, scaled_timeout, subprocess_env

        directory = tempfile.mkdtemp(prefix="warm_launcher_")
        path = os.path.join(directory, "socket")
        with open(os.path.join(directory, "server.log"), "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "tests.training.warm_launcher", path], cwd=REPO_ROOT,
                                       env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        atexit.register(_stop, process)
        deadline = time.monotonic() + scaled_timeout(STARTUP_TIMEOUT)
        while not os.path.exists(path + ".ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log.name) as failed:
                    raise RuntimeError(f"the warm launcher did not start:\n{failed.read()[-4000:]}")
            time.sleep(0.05)
        _server = (process, path)
    return _server[1]


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


class WarmProcess:
    """A script forked from the warm server: pid, poll(), wait(timeout), returncode, as subprocess.Popen."""

    def __init__(self, command: list[str], env: dict, cwd: str, output: str):
        self.args = command
        self.returncode = None
        self.pid = _call(("start", command, env, cwd, output))

    def poll(self):
        if self.returncode is None:
            self.returncode = _call(("poll", self.pid))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


if __name__ == "__main__":
    serve(sys.argv[1])
