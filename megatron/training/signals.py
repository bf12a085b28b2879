"""Stopping without loss: SIGTERM, SIGINT and SIGUSR1 ask the run to save a checkpoint and exit 0.

A cluster stops a job with a signal: SLURM sends SIGTERM at the time limit (or the signal of
``--signal=USR1@120`` two minutes before it), a user presses Ctrl-C (SIGINT), torchrun and the
deepspeed launcher pass SIGTERM and SIGINT on to their workers. The handler only records the
signal; the trainer asks every rank at each iteration boundary, in the same all-reduce as the kill
switch, so all ranks stop after the same iteration, save it (with --save), print where and how to
resume, and return normally (exit status 0). A further signal while that checkpoint is written is
recorded and ignored, so it cannot cut the save short, and so is one after it, until the process has
exited; SIGKILL remains the way to stop at once.

DataLoader workers ignore these signals (``ignore_exit_signals`` is their init function): a launcher
that signals the whole process tree would otherwise kill the batch in flight; the main process ends
its workers when it exits.
"""
import signal

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class ExitSignals:
    """Records the exit signals this process receives while installed (``with ExitSignals() as s``)."""

    def __init__(self):
        self.received: list[int] = []
        self._previous = {}

    def __enter__(self) -> "ExitSignals":
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
