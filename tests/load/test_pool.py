"""OldestFirstPool: tasks run by (priority, submission order); shutdown cancels what has not started and refuses
new work, so a reader still loading stops instead of waiting on a task no thread will run."""
from __future__ import annotations

import threading

import pytest

from shardtrain.load.pool import OldestFirstPool


def test_oldest_chunk_first_then_submission_order():
    pool = OldestFirstPool(1, "t")
    gate, ran = threading.Event(), []
    try:
        blocker = pool.submit(0, gate.wait)  # holds the only thread while the queue fills
        futs = [pool.submit(p, ran.append, tag) for p, tag in [(2, "c0"), (1, "b0"), (2, "c1"), (1, "b1"), (0, "a")]]
        gate.set()
        blocker.result(timeout=10)
        for f in futs:
            f.result(timeout=10)
        assert ran == ["a", "b0", "b1", "c0", "c1"]
    finally:
        pool.shutdown()


def test_errors_reach_the_waiter_and_shutdown_cancels_and_refuses():
    pool = OldestFirstPool(1, "t")
    with pytest.raises(ZeroDivisionError):
        pool.submit(0, lambda: 1 / 0).result(timeout=10)
    started, gate = threading.Event(), threading.Event()
    running = pool.submit(0, lambda: (started.set(), gate.wait())[1])
    assert started.wait(10)
    waiting = [pool.submit(5, gate.wait) for _ in range(3)]
    pool.shutdown()
    gate.set()
    assert running.result(timeout=10) is True
    assert all(f.cancelled() for f in waiting)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(0, print)


def test_gate_holds_tasks_past_the_frontier_until_it_advances():
    """gate(1): a task of batch p runs only once advance(f) with p <= f + 1; the awaited batch is never held,
    and shutdown releases threads waiting at the gate."""
    pool = OldestFirstPool(2, "t")
    ran: list[int] = []
    try:
        pool.gate(1)
        futs = {p: pool.submit(p, ran.append, p) for p in (3, 0, 2, 1)}
        futs[0].result(timeout=10)
        futs[1].result(timeout=10)
        assert not futs[2].done() and not futs[3].done()
        pool.advance(2)
        futs[3].result(timeout=10)
        assert sorted(ran) == [0, 1, 2, 3] and ran.index(0) < ran.index(2)
        late = pool.submit(9, ran.append, 9)
    finally:
        pool.shutdown()
    assert late.cancelled()
