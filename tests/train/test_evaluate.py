"""train/evaluate.py: validation over two real validation sets (espeak-ng speech packed by the real packer) with a
real (untrained, seeded) CTC model on the CPU: per-set counts equal the sets' own index, pooled rates are the
size-weighted combination of the per-set ones, the model is left training, and the metrics row names every set
(validation inside real training runs: tests/train/test_valsets.py)."""
from __future__ import annotations

import dataclasses

import pyarrow.parquet as pq
import pytest
import torch

from pipelines import load_pipeline
from shardtrain.train import evaluate as ev
from shardtrain.train.closedloop import with_table
from shardtrain.train.model import build_model
from shardtrain.train.overrides import apply_overrides
from shardtrain.train.step import Augmenters, Collectives, StepContext
from shardtrain.train.text import CharVocab
from shardtrain.world import World

from conftest import pack_subset

SMALL = ["model.d_model=64", "model.num_layers=1", "model.dropout=0", "train.augment=false",
         "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1", "train.tensorboard=false",
         "train.progress=false", "train.cpu_threads=1", "train.val_examples=2"]


@pytest.fixture(scope="module")
def sets(speech_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    return pack_subset(speech_corpus, root / "clean", 6), pack_subset(speech_corpus, root / "other", 4)


def test_per_set_and_pooled_figures(sets):
    a, b = sets
    sets_ = [f"train.data_url={a}", f"train.val_data_url={a}", f"train.val_extra_urls={b}",
             "train.val_names=clean,other"]
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + sets_)
    tok = CharVocab.from_index(a)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(tok), cfg.features.n_mels)
    model.train()
    cpu = torch.device("cpu")
    ctx = StepContext(cfg, World(), cpu, Collectives(World(), cpu), Augmenters(cfg, cpu))
    run = lambda: ev.evaluate(ctx, model, tok, None)  # noqa: E731
    res = run()
    assert model.training  # validation puts the model back into training mode
    assert list(res["sets"]) == ["clean", "other"]
    for name, url, n in (("clean", a, 6), ("other", b, 4)):
        s, index = res["sets"][name], pq.read_table(f"{url}/index.parquet", columns=["duration_s", "text"])
        refs = [tok.normalizer.apply(t) for t in index.column("text").to_pylist()]
        assert s["utts"] == n and s["skipped"] == 0
        assert s["audio_s"] == pytest.approx(sum(index.column("duration_s").to_pylist()), rel=1e-6)
        assert s["chars"] == sum(map(len, refs)) and s["words"] == sum(len(r.split()) for r in refs)
        assert s["tokens"] > 0 and s["cer"] > 0.5  # an untrained model gets most characters wrong
        assert len(s["examples"]) == 2 and {r for r, _ in s["examples"]} <= set(refs)
    c, o = res["sets"]["clean"], res["sets"]["other"]
    assert res["cer"] == pytest.approx((c["cer"] * c["chars"] + o["cer"] * o["chars"]) / (c["chars"] + o["chars"]))
    assert res["wer"] == pytest.approx((c["wer"] * c["words"] + o["wer"] * o["words"]) / (c["words"] + o["words"]))
    assert res["val_loss"] == pytest.approx((c["loss"] * c["tokens"] + o["loss"] * o["tokens"])
                                            / (c["tokens"] + o["tokens"]))
    assert res["val_chars"] == c["chars"] + o["chars"] and len(res["examples"]) == 4
    assert run()["val_loss"] == res["val_loss"]  # no dropout, no augmentation: the same figures again
    row = ev.metrics_row(res, 12)
    assert row["step"] == 12 and row["cer"] == res["cer"] and row["val/other/utts"] == 4
    assert isinstance(row["val/clean/chars"], int) and set(row) >= {f"val/{n}/{k}" for n in ("clean", "other")
                                                                   for k in ev.SET_KEYS}


@pytest.mark.parametrize("extra", [["stream.max_duration_s=2.2", "stream.min_duration_s=1.5"],
                                   ["stream.exclude_speakers=2770"], ["stream.speakers=5159,8518"],
                                   ["stream.bucket.max_batch_seconds=2.5"],
                                   [((2.0, 2.1), (3.0, 2.5))]])
def test_validation_scores_every_utterance_whatever_the_training_filters_and_budgets(sets, extra):
    """A training stream that filters by duration or speaker, or whose budget (or budget table entry) one dev
    utterance exceeds, left those utterances out of val CER/WER, counted nowhere in the row."""
    a, _ = sets
    table = extra[0] if isinstance(extra[0], tuple) else None
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [f"train.data_url={a}", f"train.val_data_url={a}"]
                          + ([] if table else extra))
    cfg = with_table(cfg, table) if table else cfg
    tok = CharVocab.from_index(a)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(tok), cfg.features.n_mels)
    cpu = torch.device("cpu")
    res = ev.evaluate(StepContext(cfg, World(), cpu, Collectives(World(), cpu), Augmenters(cfg, cpu)), model, tok, None)
    index = pq.read_table(f"{a}/index.parquet", columns=["duration_s", "text"])
    [s] = res["sets"].values()
    assert max(index.column("duration_s").to_pylist()) > 2.5  # the budgets above leave out the longest
    assert s["utts"] == 6 and s["chars"] == sum(len(tok.normalizer.apply(t)) for t in index.column("text").to_pylist())


def test_only_lengths_the_training_budget_cannot_hold_get_a_larger_one(sets):
    a, _ = sets
    longest = max(pq.read_table(f"{a}/index.parquet", columns=["duration_s"]).column("duration_s").to_pylist())
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + ["stream.min_duration_s=2"])
    got = ev.validation_stream(cfg.stream, a, None)
    assert got.bucket == cfg.stream.bucket and got.min_duration_s is None and got.epochs == 1  # all fit: unchanged
    small = dataclasses.replace(cfg.stream, bucket=dataclasses.replace(cfg.stream.bucket, max_batch_seconds=2.5))
    [(e1, b1), (e2, b2)] = ev.validation_stream(small, a, None).bucket.budget_table
    assert (e1, b1) == (pytest.approx(2.5), 2.5) and e2 >= longest and b2 == pytest.approx(longest)
    # d + d^2/10: 2 s costs 2.4, 4 s 5.6; the 4 s entry's budget holds 3.06 s alone; the last one holds the longest
    table = ev._fitting_table(((2.0, 3.0), (4.0, 4.0), (6.0, 10.0)), longest, 10.0)
    assert [e for e, _ in table] == [2.0, pytest.approx(3.0623, abs=1e-4), 4.0, 6.0]
    assert [b for _, b in table] == [3.0, 4.0, pytest.approx(5.6), 10.0]
