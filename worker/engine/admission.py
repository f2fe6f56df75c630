"""Admission work off the adding thread, delivered in the order it was handed in (issue 50 item 6).

A vision-language engine's `add_request` runs each request's images through the checkpoint's image processor
before the request can reach the step loop's inbox: a 1024x768 picture is ~50-70 ms of PIL and numpy on the host
(W6 on the H100: 9.6 s of a 29 s run, serial, in the thread that adds requests). PIL's resize and numpy's
arithmetic release the GIL, so a few threads overlap it (two threads on two cores: 1.9x). `OrderedPool` runs
each request's work on a bounded pool and hands the results on in submission order, so the loop admits requests
in the order they were added, and an abort never overtakes the request it names. Work that must not wait behind
the pool, or need not keep its order, goes to the inbox directly.

Owns the pool and the queue of outcomes not yet delivered; the engine owns what is delivered (its inbox).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

logger = logging.getLogger("cbq.engine")

T = TypeVar("T")

MAX_WORKERS = 8  # image processing threads at most: more adds little beside the step loop's own host work


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class OrderedPool(Generic[T]):
    """Runs work on `workers` threads and calls `deliver` with each result in submission order (from whichever
    thread finished the head of the line). Work should not raise: what it raises is logged and skipped."""

    def __init__(self, deliver: Callable[[T], None], workers: int):
        self._deliver = deliver
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="cbq-admission")
        self._lock = threading.Lock()  # the line and the delivery: two finishers never deliver out of order
        self._delivered = threading.Condition(self._lock)
        self._line: collections.deque[Future[T]] = collections.deque()
        self._num_pending = 0  # submitted, not yet delivered (counted down after delivery)

    def submit(self, work: Callable[[], T]) -> None:
        with self._lock:
            future = self._pool.submit(work)
            self._line.append(future)
            self._num_pending += 1
        future.add_done_callback(self._flush)

    def put(self, item: T) -> None:
        """Deliver `item` after everything submitted before it (no work)."""
        future: Future[T] = Future()
        future.set_result(item)
        with self._lock:
            self._line.append(future)
            self._num_pending += 1
        self._flush(future)

    def num_pending(self) -> int:
        """Handed in and not yet delivered. Zero means every delivery has returned."""
        with self._lock:
            return self._num_pending

    def wait(self) -> None:
        """Until everything handed in so far is delivered."""
        with self._delivered:
            self._delivered.wait_for(lambda: self._num_pending == 0)

    def close(self) -> None:
        """Wait for the work handed in (delivered as it finishes), then stop the threads."""
        self._pool.shutdown(wait=True)

    def _flush(self, _: Future[T]) -> None:
        with self._lock:
            while self._line and self._line[0].done():
                future = self._line.popleft()
                try:
                    self._deliver(future.result())
                except Exception:
                    logger.exception("admission work failed; its request gets no result")
                finally:
                    self._num_pending -= 1
            if self._num_pending == 0:
                self._delivered.notify_all()
