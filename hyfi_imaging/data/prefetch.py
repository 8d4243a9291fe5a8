"""Next batches read while the current step computes: a bounded background queue.

Why a thread and not only DataLoader workers: with ``data.workers: 0`` (the
default on small machines, and what a rank with one core gets) the DataLoader
reads in the training thread, so every step waits for its tiles. Reading a
zarr tile spends its time in zstd decoding and NumPy copies, which release the
GIL, so one thread overlaps it with the step's compute. With workers the
thread adds nothing harmful: it only moves the ``next()`` off the critical
path. ``depth`` bounds the memory: at most ``depth`` batches wait.

The time the consumer blocks in ``next()`` is measured (:attr:`Prefetcher.wait_s`),
which is the number the product reports as *data wait*.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")
_DONE = object()


class Prefetcher(Generic[T]):
    """Iterate ``source`` in a daemon thread, ``depth`` items ahead; ``transform`` runs there too.

    Exceptions in the thread are re-raised in the consumer at the item where they
    occurred. ``wait_s`` accumulates the seconds the consumer waited;
    ``last_wait_s`` is the wait for the latest item.

    OK::

        for batch in Prefetcher(loader, depth=2): ...
    """

    def __init__(
        self,
        source: Iterable[T],
        *,
        depth: int = 2,
        transform: Callable[[T], T] | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.wait_s = 0.0
        self.last_wait_s = 0.0
        self._thread = threading.Thread(
            target=self._fill, args=(source, transform), name="hyfi-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, source: Iterable[T], transform: Callable[[T], T] | None) -> None:
        try:
            for item in source:
                if not self._put(item if transform is None else transform(item)):
                    return
        except BaseException as err:  # re-raised in the consumer
            self._put(_Failure(err))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        began = time.perf_counter()
        item = self._queue.get()
        self.last_wait_s = time.perf_counter() - began
        self.wait_s += self.last_wait_s
        if item is _DONE:
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread (it finishes the item it is reading)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error
