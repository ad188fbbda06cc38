"""OldestFirstPool: the decode threads of one reader, which always take a row of the oldest chunk in flight first."""
from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future


class OldestFirstPool:
    """Decode threads that always take a row of the oldest chunk in flight first.

    A FIFO pool interleaves the rows of the chunks being prefetched, so the next batch waited for its
    neighbours' decodes too: first batch ~0.05 s with FIFO against ~0.04 s oldest-first (measured locally, 2
    chunks in flight).
    Tasks are ordered by (priority, submission order); `shutdown` cancels what has not started.
    """

    _STOP = (float("inf"), -1, None, None, ())

    def __init__(self, threads: int, name: str):
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn, *args) -> Future:
        """Queue `fn(*args)`; after `shutdown` raises RuntimeError (a reader still loading then stops, instead of
        waiting forever on a task no thread will run)."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("decode pool is shut down")
            self._q.put((priority, next(self._order), fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            _, _, fut, fn, args = self._q.get()
            if fut is None:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting reader
                    fut.set_exception(e)
            del fut, fn, args  # an idle thread must not keep its last task's batch and run buffers alive

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item[2] is not None:
                item[2].cancel()
        for _ in self._threads:
            self._q.put(self._STOP)
