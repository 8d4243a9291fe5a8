"""The background prefetcher: order, errors, bounded read-ahead, stopping, wait accounting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from hyfi_imaging.data.prefetch import Prefetcher


def test_items_in_order_with_transform() -> None:
    assert list(Prefetcher(range(10), depth=2, transform=lambda v: v * 10)) == [
        v * 10 for v in range(10)
    ]


def test_error_reaches_the_consumer_at_its_item() -> None:
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise OSError("disk gone")

    feed = Prefetcher(source())
    assert next(feed) == 1 and next(feed) == 2
    with pytest.raises(OSError, match="disk gone"):
        next(feed)


def test_reads_ahead_at_most_depth_items() -> None:
    produced: list[int] = []

    def source() -> Iterator[int]:
        for i in range(100):
            produced.append(i)
            yield i

    feed = Prefetcher(source(), depth=2)
    time.sleep(0.3)
    # depth waiting in the queue plus the one the thread holds while blocked
    assert len(produced) <= 3
    feed.close()


def test_close_stops_the_thread() -> None:
    def endless() -> Iterator[int]:
        i = 0
        while True:
            yield i
            i += 1

    feed = Prefetcher(endless(), depth=1)
    next(feed)
    feed.close()
    assert not any(t.name == "hyfi-prefetch" and t.is_alive() for t in threading.enumerate())


def test_wait_counts_only_time_blocked() -> None:
    def slow() -> Iterator[int]:
        for i in range(3):
            time.sleep(0.1)
            yield i

    feed = Prefetcher(slow(), depth=3)
    time.sleep(0.5)  # everything is read while "the step computes"
    assert list(feed) == [0, 1, 2]
    assert feed.wait_s < 0.05


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Prefetcher([1], depth=0)
