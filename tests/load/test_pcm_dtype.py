"""float32 batches are decoded straight to float32: they must equal the int16 PCM / 32768, bit for bit."""
import torch
from conftest import pack_subset

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.world import World


def _epoch(url, **kw):
    ld = build_loader(url, world=World(), seed=0, cfg=StreamConfig(epochs=1, **kw))
    return {k: w[:n].clone() for b, _ in ld for k, w, n in zip(b.keys, b.waves, b.lengths.tolist())}


def test_float32_equals_int16_over_32768(tone_corpus, tmp_path):
    url = pack_subset(tone_corpus, tmp_path, 8)
    pcm = _epoch(url, pcm_dtype="int16")
    direct = _epoch(url)
    assert len(pcm) == 8 and set(direct) == set(pcm)
    for k, w in pcm.items():
        assert w.dtype == torch.int16 and w.abs().max() > 0
        assert direct[k].dtype == torch.float32
        assert torch.equal(direct[k], w.float() / 32768)
