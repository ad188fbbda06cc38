"""NoiseBank.from_dataset reads members by the loader's path (load.reader.read_members): same checks, same skips."""
import logging
import os
import shutil

import numpy as np
import soundfile
import torch

from shardtrain.format.manifest import open_dataset
from shardtrain.load.reader import read_members
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.train.augment import NoiseBank

RATE = 16000


def _pack(tmp_path, durs, **corpus_kw):
    corpus = make_corpus(tmp_path / "corpus", durs, seed=5, **corpus_kw)
    out = tmp_path / "ds"
    pack(PackConfig(input=str(corpus), output=str(out), max_samples_per_shard=2, workers=1, progress=False))
    return str(out)


def test_bank_holds_what_the_loader_path_decodes_in_seed_order(tmp_path):
    url = _pack(tmp_path, [0.5, 0.8, 1.1, 0.6, 0.9])
    bank = NoiseBank.from_dataset(url, max_seconds=100.0, sample_rate_hz=RATE, seed=7)
    order = torch.randperm(5, generator=torch.Generator().manual_seed(7)).tolist()
    members = list(read_members(open_dataset(url), order))
    assert bank.names == [m.key for m in members]
    for i, m in enumerate(members):
        assert int(bank.lengths[i]) == len(m.samples)
        np.testing.assert_array_equal(bank.waves[i, : len(m.samples)].numpy(), m.samples)


def test_corrupt_member_is_skipped_with_a_warning(tmp_path, caplog):
    url = _pack(tmp_path, [0.5, 0.8, 1.1, 0.6])
    rows = open_dataset(url).read_index().to_pylist()
    bad = rows[1]
    with open(os.path.join(url, f"shard-{bad['shard']:06d}.tar"), "r+b") as f:
        f.seek(bad["audio_offset"])
        f.write(b"XXXX" + os.urandom(1000))
    with caplog.at_level(logging.WARNING, logger="shardtrain.train.augment"):
        bank = NoiseBank.from_dataset(url, max_seconds=100.0, sample_rate_hz=RATE)
    assert bank.names == [r["key"] for r in rows if r["key"] != bad["key"]]
    assert any(bad["key"] in r.message and "decode_error" in r.message for r in caplog.records)


def test_stereo_8k_clips_are_averaged_and_resampled(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    t = np.arange(8000) / 8000
    left, right = np.sin(2 * np.pi * 200 * t), np.sin(2 * np.pi * 200 * t + 0.5)
    soundfile.write(src / "n0.wav", np.stack([left, right], 1).astype(np.float32) * 0.5, 8000, subtype="PCM_16")
    (src / "n0.txt").write_text("noise")
    out = tmp_path / "ds"
    pack(PackConfig(input=str(src), output=str(out), progress=False))
    bank = NoiseBank.from_dataset(str(out), max_seconds=10.0, sample_rate_hz=RATE)
    assert bank.lengths.tolist() == [RATE]  # 1 s, whatever rate the pack stored it at
    mid = bank.waves[0, 4000:12000].numpy()
    peak = 0.5 * np.abs(np.cos(0.25))  # the mean of two sines 0.5 rad apart
    assert abs(np.abs(mid).max() - peak) < 0.02


def test_start_up_reads_the_index_once(tmp_path, monkeypatch):
    """The row count comes from the manifest; index.parquet is read once, by read_members (its checked columns)."""
    from shardtrain.format.manifest import Dataset

    url = _pack(tmp_path, [0.5, 0.8, 1.1])
    reads: list = []
    real = Dataset.read_index
    monkeypatch.setattr(Dataset, "read_index", lambda self, columns=None: reads.append(columns) or real(self, columns))
    bank = NoiseBank.from_dataset(url, max_seconds=100.0, sample_rate_hz=RATE, seed=7)
    assert len(bank.names) == 3 and len(reads) == 1, reads
