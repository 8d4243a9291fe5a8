"""Preemption: a scheduler's signal ends the run at a step, with a checkpoint and one line.

Why at a step: a scheduler (SLURM's ``--signal``, a time limit, ``scancel
--signal=TERM``, a preemption) sends SIGTERM or SIGUSR1 and kills the job a
while later. The work since the last checkpoint is lost unless the run saves
now, and a checkpoint is only consistent between steps, written by every rank
together. So the handler only notes the signal; the rank passes the note to
the next ``train_step``, whose one all-reduce tells every rank (a signal
delivered to one rank is enough); every rank then finishes that step, writes
one checkpoint and exits with :data:`REQUEUE_EXIT` (EX_TEMPFAIL), which a job
script can hand to ``scontrol requeue``. A relaunch resumes exactly.

A second SIGTERM ends the process at once (the default action): the
scheduler's own escalation, or a user who will not wait for the step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = [
    "REQUEUE_EXIT",
    "STOP_SIGNALS",
    "StopSignals",
    "ignore_stop_signals",
    "stop_signals_blocked",
]

#: The exit status of a run stopped by a signal after its checkpoint (EX_TEMPFAIL).
REQUEUE_EXIT = 75
#: Signals that ask the run to stop at its next step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Once installed, SIGTERM and SIGUSR1 set :attr:`received` instead of ending the process."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.received is not None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # asked twice: go now
            signal.raise_signal(signal.SIGTERM)
        self.received = self.received or signal.Signals(signum)

    def install(self) -> StopSignals:
        """Catch the stop signals (in the main thread, where Python runs handlers)."""
        if threading.current_thread() is threading.main_thread():  # where handlers run
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


# A scheduler signals every process of the job step, the data-loading workers too. A worker
# that died of it (the default action) ended its rank with an error: no checkpoint, no
# requeue. The rank acts on the signal; its workers ignore it and end with the rank. A
# worker is born with the signals blocked (a signal mask survives fork and exec; a blocked
# signal waits, it is not lost), so one sent while it starts (the spawn and its imports
# take a second) waits until its first act, :func:`ignore_stop_signals`, discards it.


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals in this thread (and in processes it starts) for the block: they
    go to another thread of this process meanwhile, or wait for the block's end."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A data-loading worker's start (``DataLoader(worker_init_fn=...)``, the workers started
    under :func:`stop_signals_blocked`): the stop signals are ignored, then unblocked."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
