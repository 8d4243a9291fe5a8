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

import signal
import threading
from types import FrameType

__all__ = ["REQUEUE_EXIT", "STOP_SIGNALS", "StopSignals"]

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
