"""float32 batches are decoded straight to float32 in the training process and converted from int16 after worker
processes: both must equal the int16 PCM / 32768, bit for bit."""
import torch
from conftest import pack_subset

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.world import World


def _epoch(url, **kw):
    ld = build_loader(url, world=World(), seed=0, cfg=StreamConfig(epochs=1, **kw))
    return {k: w[:n].clone() for b, _ in ld for k, w, n in zip(b.keys, b.waves, b.lengths.tolist())}


def test_float32_in_process_and_from_workers_equal_int16_over_32768(tone_corpus, tmp_path):
    url = pack_subset(tone_corpus, tmp_path, 8)
    pcm = _epoch(url, pcm_dtype="int16")
    direct = _epoch(url)
    workers = _epoch(url, num_workers=1)
    assert len(pcm) == 8 and set(direct) == set(pcm) == set(workers)
    for k, w in pcm.items():
        assert w.dtype == torch.int16 and w.abs().max() > 0
        assert direct[k].dtype == workers[k].dtype == torch.float32
        assert torch.equal(direct[k], w.float() / 32768) and torch.equal(workers[k], direct[k])
