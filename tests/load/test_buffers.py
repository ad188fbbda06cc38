"""BatchBuffers: a block is reused only once nothing refers to the batch it held (views, tensors included)."""
import numpy as np
import torch

from shardtrain.load.buffers import BatchBuffers


def test_block_comes_back_only_when_every_view_is_gone():
    pool = BatchBuffers(keep=4)
    pcm = pool.take(3, 1000, np.float32)
    row = pcm[1, :10]
    tensor = torch.from_numpy(pcm)[2]  # a tensor view of the batch, as a trainer holds it
    as_numpy = tensor.numpy()[5:]
    del pcm
    assert pool.free_blocks() == 0  # a row view and a tensor view still hold it
    del row, tensor
    assert pool.free_blocks() == 0
    del as_numpy
    assert pool.free_blocks() == 1
    again = pool.take(2, 1000, np.float32)  # same memory, no new block
    assert pool.fresh == 1 and pool.free_blocks() == 0 and again.shape == (2, 1000)


def test_memory_in_use_is_never_handed_out_twice():
    pool = BatchBuffers(keep=8)
    held = [pool.take(4, 5000, np.int16) for _ in range(5)]
    for i, a in enumerate(held):
        a[:] = i
    held.append(pool.take(4, 5000, np.int16))  # nothing free: a new block
    assert pool.fresh == 6
    for i, a in enumerate(held[:5]):
        assert (a == i).all()
    assert not any(np.shares_memory(a, b) for j, a in enumerate(held) for b in held[j + 1:])


def test_free_blocks_stay_bounded():
    pool = BatchBuffers(keep=2)
    held = [pool.take(1, 1 << 20, np.uint8) for _ in range(5)]
    del held
    assert pool.free_blocks() == 2
    big = pool.take(1, 8 << 20, np.uint8)  # no free block holds it: one is given back first
    assert pool.free_blocks() == 1 and big.nbytes == 8 << 20


def test_a_batch_freed_by_garbage_collection_inside_take_does_not_deadlock():
    """A finalizer may run in the middle of `take` (a collection of a cycle holding a batch); it must not wait on
    the pool's lock."""
    import gc

    pool = BatchBuffers(keep=4)

    class Holder:
        pass

    h = Holder()
    h.me, h.pcm = h, pool.take(2, 100, np.float32)  # a reference cycle: only the collector frees it
    del h
    gc.disable()
    try:
        with pool._lock:  # as if a collection ran while take() holds the lock
            gc.collect()
    finally:
        gc.enable()
    assert pool.free_blocks() == 1


def test_a_memory_cap_names_the_allocation_and_the_knobs(tmp_path):
    """Under a real address-space limit (`ulimit -v`, in a child), a 2-hour utterance's batch does not fit: the
    error is one line with the size, what it was for and what to change, and still ENOMEM."""
    import subprocess
    import sys

    child = (
        "import errno, resource, sys\n"
        "import numpy as np\n"
        "from shardtrain.load.buffers import BatchBuffers\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    BatchBuffers(2).take(1, 2 * 3600 * 16000, np.float32)\n"
        "except OSError as e:\n"
        "    print(e.errno == errno.ENOMEM, e)\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    out = p.stdout.strip()
    assert p.returncode == 0 and out.startswith("True "), (out, p.stderr[-2000:])
    assert "cannot allocate 461 MB" in out and "1 utterances x 115,200,000 samples" in out, out
    assert "stream.bucket.max_batch_seconds" in out and "ulimit -v" in out and "\n" not in out, out


def test_released_pages_read_as_zeros_and_the_rest_is_kept():
    """release_pages gives back only whole pages inside the range: the partial pages at both ends keep their
    bytes (they may hold a neighbour's header), the inside reads as zeros (the kernel's fresh pages)."""
    from shardtrain.load.buffers import PAGE, release_pages

    pool = BatchBuffers(keep=0)
    run = pool.take(1, 8 * PAGE, np.uint8)[0]
    run[:] = 7
    release_pages(run, 100, 5 * PAGE + 100)
    assert (run[:PAGE] == 7).all() and (run[5 * PAGE:] == 7).all()
    assert (run[PAGE:5 * PAGE] == 0).all()
    release_pages(run, 6 * PAGE + 1, 7 * PAGE - 1)  # no whole page inside: nothing released
    assert (run[5 * PAGE:] == 7).all()


def test_spans_released_in_one_call_or_one_by_one_leave_the_same_bytes():
    """release_spans: the whole pages inside each range read as zeros, every other byte is kept, whether the
    ranges go in one process_madvise (Linux >= 6.13) or, where that is refused, through madvise one by one."""
    from shardtrain.load import buffers
    from shardtrain.load.buffers import PAGE, release_spans

    spans = [(100, 3 * PAGE + 5), (5 * PAGE, 7 * PAGE), (9 * PAGE + 1, 10 * PAGE - 1), (11 * PAGE, 12 * PAGE + 9)]
    expect = np.full(16 * PAGE, 7, np.uint8)
    for lo, hi in ((PAGE, 3 * PAGE), (5 * PAGE, 7 * PAGE), (11 * PAGE, 12 * PAGE)):
        expect[lo:hi] = 0
    was = buffers._PROCESS_MADVISE.on
    try:
        for one_call in (True, False):
            buffers._PROCESS_MADVISE.on = one_call and was
            pool = BatchBuffers(keep=0)
            run = pool.take(1, 16 * PAGE, np.uint8)[0]
            run[:] = 7
            release_spans([(run.ctypes.data + a, run.ctypes.data + b) for a, b in spans])
            assert np.array_equal(run, expect), one_call
    finally:
        buffers._PROCESS_MADVISE.on = was
