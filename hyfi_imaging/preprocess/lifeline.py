"""Worker processes that end when the run that started them ends, however it ends.

Why this is needed: ``hyfi-preprocess --workers N`` runs its workers under a
``forkserver``. When the run is killed with ``kill -9`` (or by the OOM killer,
or a batch system), nothing tells the workers: each holds the write end of
its own task queue and of the forkserver's "alive" pipe, so neither the
workers nor the forkserver ever see end-of-file. They were measured to finish
the slides in hand and then wait forever, orphaned.

Why not only ``prctl(PR_SET_PDEATHSIG)``: that signal follows the *direct*
parent, and a worker's parent is the forkserver, which itself stays alive
because of the workers. So each worker watches the run's own process: a
thread blocks on a pidfd of that process (Linux >= 5.3; elsewhere it polls
``kill(pid, 0)`` twice a second) and ends the worker with ``os._exit`` the
moment the run is gone, even in the middle of a conversion. The unfinished
temporary store is removed by the next run. ``PR_SET_PDEATHSIG`` is set as
well, so that a killed forkserver takes its workers with it. Once the workers
are gone, the forkserver and multiprocessing's resource tracker see their
pipes close and exit by themselves.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

__all__ = ["EXIT_ORPHANED", "exit_with"]

#: Exit status of a worker whose run has gone.
EXIT_ORPHANED = 3
#: Exit status of a worker ended by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def _set_parent_death_signal(sig: signal.Signals) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _wait_for_exit(pid: int) -> None:
    """Return when process ``pid`` has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # not Linux, or a kernel without pidfd
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(_POLL_S)
    try:
        select.select([fd], [], [])  # a pidfd turns readable when its process ends
    finally:
        os.close(fd)


def _watch(pid: int) -> None:
    _wait_for_exit(pid)
    os._exit(EXIT_ORPHANED)


def exit_with(pid: int) -> None:
    """Make this process exit as soon as process ``pid`` ends (``kill -9`` included).

    Meant as a ``ProcessPoolExecutor`` initializer, with the pid of the process
    that owns the pool: ``initializer=exit_with, initargs=(os.getpid(),)``.
    """
    _set_parent_death_signal(signal.SIGKILL)
    threading.Thread(target=_watch, args=(pid,), name="hyfi-lifeline", daemon=True).start()
    # Ctrl-C reaches every process of the terminal's group: a worker ends at once, without a
    # traceback of its own (its store stays a .tmp the next run removes); the owner says it.
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
