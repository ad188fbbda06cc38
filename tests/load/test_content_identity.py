"""Changed bytes are refused, never mixed: a same-layout re-pack (WAV shards, one file's samples replaced, so every
offset, size and duration is the same and the index fingerprint cannot tell) changes the dataset's content id
(shard sha256s), and a loader state saved before it, or a ledger written before it, is refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.errors import StreamError
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import AudioTarget, PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

DURS = [0.5 + 0.1 * (i % 9) for i in range(24)]
CFG = StreamConfig(bucket=BucketConfig(max_batch_seconds=3.0, chunk_mb=0.01))


def repack_changed(corpus, out: str, storage_options=None) -> None:
    """Replace utt-00003's samples (same length, same format) and pack again over the same OUTPUT."""
    path = corpus / "utt-00003.wav"
    x, rate = sf.read(path, dtype="int16")
    sf.write(path, (-x).astype(np.int16), rate, subtype="PCM_16")
    pack(PackConfig(input=str(corpus), output=out, audio=AudioTarget(codec="wav"), max_samples_per_shard=6,
                    overwrite=True, progress=False, storage_options=storage_options))


def pack_and_save_state(tmp_path, out: str, storage_options=None):
    corpus = make_corpus(tmp_path / "corpus", DURS, fmt="wav", seed=3)
    pack(PackConfig(input=str(corpus), output=out, audio=AudioTarget(codec="wav"), max_samples_per_shard=6,
                    progress=False,
                    storage_options=storage_options))
    loader = build_loader(out, world=World(), seed=0, cfg=CFG, storage_options=storage_options)
    it = iter(loader)
    _, state = next(it)
    it.close()
    return corpus, state


def test_same_layout_repack_changes_the_content_id_not_the_index_and_resume_is_refused(tmp_path):
    out = str(tmp_path / "ds")
    corpus, state = pack_and_save_state(tmp_path, out)
    before = open_dataset(out)
    index_before = build_loader(out, world=World(), seed=0, cfg=CFG).fingerprint
    repack_changed(corpus, out)
    after = open_dataset(out)
    assert [s.bytes for s in after.shards] == [s.bytes for s in before.shards]  # the same layout
    assert build_loader(out, world=World(), seed=0, cfg=CFG).fingerprint == index_before
    assert after.content_id != before.content_id
    with pytest.raises(StreamError, match="changed since this state was saved"):
        build_loader(out, world=World(), seed=0, cfg=CFG, state=state)
    legacy = {k: v for k, v in state.items() if k != "content"}  # a state from before content ids still resumes
    assert next(iter(build_loader(out, world=World(), seed=0, cfg=CFG, state=legacy)))[0] is not None


@pytest.mark.s3
def test_same_layout_repack_on_s3_refuses_the_resume(tmp_path, s3, s3_bucket):
    so = s3.storage_options
    out = f"{s3_bucket}/ds"
    corpus, state = pack_and_save_state(tmp_path, out, so)
    repack_changed(corpus, out, so)
    with pytest.raises(StreamError, match="changed since this state was saved"):
        build_loader(out, world=World(), seed=0, cfg=CFG, state=state, storage_options=so)


def test_ledger_after_a_same_layout_repack_is_refused_in_one_line(tmp_path, capsys):
    from pipelines import load_pipeline
    from shardtrain.cli.app import main
    from shardtrain.train.loop import train
    from shardtrain.train.overrides import apply_overrides

    out = str(tmp_path / "ds")
    corpus, _ = pack_and_save_state(tmp_path, out)
    run = tmp_path / "run"
    cfg = apply_overrides(load_pipeline("tiny_cpu"), [
        "model.d_model=32", "model.num_layers=1", "train.augment=false", "train.tensorboard=false",
        "train.progress=false", "train.cpu_threads=1", "train.val_every_steps=0", "stream.bucket.max_batch_seconds=3",
        f"train.data_url={out}", f"train.out_dir={run}", "train.max_steps=2"])
    train(cfg, World())
    assert main(["ledger", str(run)]) == 0
    capsys.readouterr()
    repack_changed(corpus, out)
    assert main(["ledger", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # the re-pack's own log lines come first
    assert err[-1].startswith("ledger: error: ") and "changed since attempt" in err[-1] and out in err[-1]


def test_a_loader_names_each_datasets_content_id_in_source_order(tmp_path):
    """Loader.content_ids: what the trainer's ledger records, from the manifests the planner opened."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for out, seed in ((a, 3), (b, 4)):
        corpus = make_corpus(tmp_path / f"corpus{seed}", DURS, fmt="wav", seed=seed)
        pack(PackConfig(input=str(corpus), output=out, audio=AudioTarget(codec="wav"), max_samples_per_shard=6,
                        progress=False))
    ids = [open_dataset(a).content_id, open_dataset(b).content_id]
    assert ids[0] != ids[1]
    assert build_loader(a, world=World(), seed=0, cfg=CFG).content_ids == ids[:1]
    assert build_loader([(b, 1.0), (a, 2.0)], world=World(), seed=0, cfg=CFG).content_ids == ids[::-1]
