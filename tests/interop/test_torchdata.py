"""interop/torchdata.py on a real packed dataset: torch/torchdata DataLoaders over BatchStream, the loader's
state_dict resume, and Batch moves. (lhotse, Hugging Face: test_lhotse.py, test_hf.py.)"""
from __future__ import annotations

import pytest
import torch

from shardtrain.interop.torchdata import BatchStream
from shardtrain.load.batch import Batch
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.world import World

from conftest import pack_tones

DURS = [0.3 + 0.2 * ((i * 7) % 13) for i in range(40)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_tones(tmp_path_factory.mktemp("interop"), DURS, seed=3)


def loader(url, world=World(), state=None):
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=5.0, chunk_mb=0.05, num_buckets=3), epochs=2)
    return build_loader(url, world=world, seed=7, cfg=cfg, state=state)


def sig(b: Batch) -> tuple:
    return (b.epoch, b.step, tuple(b.keys), tuple(b.texts), b.waves.sum().item())


def test_dataloader_batch_size_none_yields_the_loaders_batches(dataset):
    want = [sig(b) for b, _ in loader(dataset)]
    dl = torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None)
    got = [sig(b) for b in dl]
    assert got == want and len(want) > 6 and {w[0] for w in want} == {0, 1}
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None, num_workers=1)))



def test_a_second_pass_over_a_consumed_loader_says_why_it_is_empty(dataset, caplog):
    """`for epoch in range(N): for b in dl` over a loader of fewer epochs: the later passes were silently empty."""
    dl = torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None)
    assert sum(1 for _ in dl) > 6
    with caplog.at_level("WARNING", logger="shardtrain.interop.torchdata"):
        assert sum(1 for _ in dl) == 0
    assert "epochs (stream.epochs=2) are all consumed" in caplog.text


def test_loader_load_state_dict_resumes_at_the_next_batch(dataset):
    full = [sig(b) for b in loader(dataset).batches()]
    first = loader(dataset)
    it = first.batches()
    head = [sig(next(it)) for _ in range(5)]
    state = first.state_dict()
    it.close()  # stops the first loader's read-ahead
    again = loader(dataset)
    again.load_state_dict(state)
    assert head + [sig(b) for b in again.batches()] == full
    assert again.state_dict()["counters"]["batches"] == len(full)


def test_stateful_dataloader_checkpoint_carries_the_cursor(dataset):
    from torchdata import stateful_dataloader as sdl
    full = [sig(b) for b in loader(dataset).batches()]
    dl = sdl.StatefulDataLoader(BatchStream(loader(dataset)), batch_size=None)
    it = iter(dl)
    head = [sig(next(it)) for _ in range(4)]
    sd = dl.state_dict()
    assert sd["dataset_state"]["step"] == 4  # the loader's own cursor, not a count of items to replay
    dl2 = sdl.StatefulDataLoader(BatchStream(loader(dataset)), batch_size=None)
    dl2.load_state_dict(sd)
    assert head + [sig(b) for b in dl2] == full


def test_batch_moves_like_a_tensor_container(dataset):
    b = next(loader(dataset).batches())
    m = b.to("meta")
    assert isinstance(m, Batch) and m.keys == b.keys and m.texts == b.texts
    assert {t.device.type for t in (m.waves, m.lengths, m.durations_s)} == {"meta"} and b.waves.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning and CUDA copies need a GPU")
def test_batch_pins_and_copies_to_cuda(dataset):
    b = next(loader(dataset).batches())
    p = b.pin_memory()
    assert p.waves.is_pinned() and p.lengths.is_pinned() and not b.waves.is_pinned()
    c = p.to("cuda", non_blocking=True)
    assert c.waves.is_cuda and torch.equal(c.waves.cpu(), b.waves) and c.keys == b.keys
    dl = torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None, pin_memory=True)
    assert next(iter(dl)).waves.is_pinned()


