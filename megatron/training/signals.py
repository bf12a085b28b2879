"""Stopping without loss: SIGTERM, SIGINT and SIGUSR1 ask the run to save a checkpoint and exit 0.

A cluster stops a job with a signal: SLURM sends SIGTERM at the time limit (or the signal of
``--signal=USR1@120`` two minutes before it), a user presses Ctrl-C (SIGINT), torchrun and the
deepspeed launcher pass SIGTERM and SIGINT on to their workers. The handler only records the
signal; the trainer asks every rank at each iteration boundary, in the same all-reduce as the kill
switch, so all ranks stop after the same iteration, save it (with --save), print where and how to
resume, and return normally (exit status 0). A further signal while that checkpoint is written is
recorded and ignored, so it cannot cut the save short, and so is one after it, until the process has
exited; SIGKILL remains the way to stop at once.

A launcher that is itself killed may leave its ranks behind: the ``deepspeed`` runner forwards no
signal on one node (``kill PID`` ends it alone, and ``deepspeed.launcher.launch`` with the ranks
lives on), and a torchrun agent ended by SIGKILL cannot forward one. ``LauncherWatch`` notices at
each iteration boundary that a launcher process above this rank is gone (its place in the process
tree changed) and the run stops as for SIGTERM: checkpoint, a line saying why, exit 0.

DataLoader workers ignore these signals (``ignore_exit_signals`` is their init function): a launcher
that signals the whole process tree would otherwise kill the batch in flight; the main process ends
its workers when it exits, and ``end_worker_processes`` kills any left at interpreter exit, where
multiprocessing would otherwise wait forever for a worker that ignores its SIGTERM.
"""
import atexit
import multiprocessing
import os
import signal
import sys
import threading

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class ExitSignals:
    """Records the exit signals this process receives while installed (``with ExitSignals() as s``);
    ``launcher`` watches the launcher processes above it (LauncherWatch)."""

    def __init__(self):
        self.received: list[int] = []
        self._previous = {}
        self.launcher: LauncherWatch | None = None

    def __enter__(self) -> "ExitSignals":
        self.launcher = LauncherWatch()
        for number in EXIT_SIGNALS:
            self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        """Restore the previous handlers; after a received signal the process is on its way out, so
        further exit signals stay ignored instead (a default handler would end it by the signal, a
        non-zero status, in the middle of its last lines)."""
        for number, handler in self._previous.items():
            signal.signal(number, signal.SIG_IGN if self.received else handler)
        self._previous.clear()

    def _record(self, number, frame) -> None:
        self.received.append(number)

    @property
    def first(self) -> int:
        """The number of the first signal received, 0 when none was."""
        return self.received[0] if self.received else 0


def signal_name(number: int) -> str:
    return signal.Signals(number).name


def ignore_exit_signals(worker_id: int | None = None) -> None:
    """DataLoader worker_init_fn: leave the exit signals to the main process."""
    for number in EXIT_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


_workers_ended_at_exit = False


def end_worker_processes_at_exit() -> None:
    """Register ``end_worker_processes`` to run at interpreter exit (once per process)."""
    global _workers_ended_at_exit
    if not _workers_ended_at_exit:
        _workers_ended_at_exit = True
        # Registered after multiprocessing's own exit handler, hence run before it (atexit is last in, first out).
        atexit.register(end_worker_processes)


def end_worker_processes() -> None:
    """SIGKILL this process's daemonic multiprocessing children (DataLoader workers) still running.

    Workers whose loader was closed have ended already; one left over (an error skipped the close)
    ignores SIGTERM, and multiprocessing's exit handler would terminate and then join it forever."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()


# How a launcher process shows in its command line: the first arguments' names, or a module run with -m.
LAUNCHER_PROGRAMS = ("deepspeed", "ds", "torchrun")
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                    "torch.distributed.launch")


def process_parent(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc, None when the process is gone or /proc is unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ')'.
    return int(stat[stat.rindex(")") + 2:].split()[1])


def process_command(pid: int) -> list[str]:
    """The arguments of ``pid``'s command line from /proc, [] when the process is gone or /proc is unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def launcher_name(command: list[str]) -> str | None:
    """The launcher a process command line runs ("deepspeed.launcher.launch", "torchrun", ...), or None."""
    for argument in command[:2]:
        if os.path.basename(argument) in LAUNCHER_PROGRAMS:
            return os.path.basename(argument)
    return next((argument for argument in command[1:4] if argument in LAUNCHER_MODULES), None)


class LauncherWatch:
    """The launcher processes above this one (nearest first), remembered at start; ``gone()`` tells
    whether one of them has ended since.

    Each remembered launcher must still be the parent of the process below it: when a launcher ends,
    the kernel gives its children to init (or a subreaper), so the link changes. The topmost
    launcher's own parent (a shell, a batch script) is not watched: ``nohup deepspeed ...`` outlives
    its terminal. Without /proc (not Linux) only this process's parent is watched.
    """

    def __init__(self, parent_of=process_parent, command_of=process_command):
        self._parent_of = parent_of
        self.chain: list[tuple[int, str]] = []  # (pid, launcher name)
        pid = os.getppid()
        while pid > 1:
            name = launcher_name(command_of(pid))
            if name is None:
                break
            self.chain.append((pid, name))
            pid = parent_of(pid) or 0
        self.ended: tuple[int, str] | None = None

    def gone(self) -> bool:
        """Whether a remembered launcher has ended (checked again until one has; cheap: a few /proc reads)."""
        if self.ended is None and self.chain:
            below_parent = os.getppid()
            for index, (pid, name) in enumerate(self.chain):
                if below_parent != pid:
                    self.ended = (pid, name)
                    break
                if index + 1 < len(self.chain):
                    below_parent = self._parent_of(pid)
        return self.ended is not None

    def description(self) -> str:
        """``the deepspeed launcher (pid 123) has ended`` for the stop line."""
        if self.ended is None:
            return "no launcher has ended"
        pid, name = self.ended
        return f"the {name} launcher (pid {pid}) has ended"


def run_exit_handlers() -> None:
    """What the interpreter does at exit before its finalization: join the non-daemon threads, run the
    atexit handlers, flush stdout and stderr."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def exit_without_finalization(status: int = 0) -> None:
    """End the process with ``status`` after ``run_exit_handlers``, skipping the interpreter's finalization.

    After a complete run (checkpoint saved, process groups destroyed) torch's C++ teardown during
    finalization aborted a rank now and then ("terminate called without an active exception",
    SIGABRT: a finished job reported as failed); nothing of the run is left for finalization to do."""
    run_exit_handlers()
    os._exit(status)
