"""Several validation sets, each reporting its own loss / CER / WER (issue 11): names, the CLI, the start-up
check, and real training runs (one process in-process; two processes under real torchrun) on packed espeak-ng
speech, with one validation set on a real SeaweedFS server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import load_pipeline
from shardtrain.cli.app import build_parser, main
from shardtrain.cli.train import _val_fields
from shardtrain.format.manifest import DatasetError
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.train.config import TrainConfig
from shardtrain.train.loop import train
from shardtrain.train.overrides import apply_overrides
from shardtrain.train.valsets import derive_names, split_named, val_sets
from shardtrain.world import World

# as tests/train/test_loop.py: a 0.6M-parameter model, every batch = all six training utterances, no augmentation
SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=3", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
         "train.tensorboard=false", "train.progress=false", "train.cpu_threads=1"]
PER_SET = ("loss", "cer", "wer", "utts", "audio_s", "chars", "words", "tokens", "skipped")


def test_names_derived_from_urls_unique_and_bad_ones_refused():
    assert derive_names(["s3://b/librispeech/dev-clean", "/data/ls/dev-other"]) == ("dev-clean", "dev-other")
    # clashing derived names take in parent components, then -2; a given name is kept as given
    assert derive_names(["/a/x/shards", "/b/y/shards/", "s3://c/shards"]) == ("x-shards", "y-shards", "c-shards")
    assert derive_names(["dev", "/x/other"], ["", "dev"]) == ("dev-2", "dev")
    assert derive_names(["a b", "a_b"]) == ("a_b", "a_b-2")  # sanitised, then made unique
    assert split_named("clean=s3://b/dev-clean") == ("clean", "s3://b/dev-clean")
    assert split_named("s3://b/lang=en") == ("", "s3://b/lang=en") and split_named("./k=v") == ("", "./k=v")
    for urls, names, msg in [(["/a", "/a/"], [], "given twice"), (["/a", "/b"], ["x", "x"], "'x' is given twice"),
                             (["/a"], ["no good"], "letters, digits"), (["/a", "/b"], ["x"], "1 names for 2")]:
        with pytest.raises(ValueError, match=msg):
            derive_names(urls, names)
    with pytest.raises(ValueError, match="val_extra_urls needs train.val_data_url"):
        TrainConfig(val_extra_urls=("/b",))
    with pytest.raises(ValueError, match="given twice"):  # refused when the config is built, not at step 200
        apply_overrides(load_pipeline("tiny_cpu"), ["train.val_data_url=/a", "train.val_extra_urls=/b,/a"])
    # the single-set path (presets, --set train.val_data_url) is unchanged: one set named after its folder
    tc = apply_overrides(load_pipeline("tiny_cpu"), ["train.val_data_url=s3://b/dev"]).train
    assert [(s.name, s.url) for s in val_sets(tc)] == [("dev", "s3://b/dev")]


def test_cli_repeated_val_data_and_names():
    args = build_parser().parse_args(["train", "--data", "d", "--out", "o", "--val-data", "clean=s3://b/dev-clean",
                                      "--val-data", "/data/dev-other"])
    tc = TrainConfig(data_url="d", **_val_fields(args.val_data))
    assert tc.val_data_url == "s3://b/dev-clean" and tc.val_extra_urls == ("/data/dev-other",)
    assert [s.name for s in val_sets(tc)] == ["clean", "dev-other"]
    assert _val_fields([]) == {}  # no --val-data keeps the preset's and --set's validation sets
    one = TrainConfig(data_url="d", **_val_fields(["s3://b/dev"]))
    assert (one.val_data_url, one.val_extra_urls, one.val_names) == ("s3://b/dev", (), ())


@pytest.fixture(scope="module")
def six(six_utts) -> str:
    return six_utts  # conftest's six packed utterances, shared with the loop, preempt and inference tests


def test_unreadable_validation_set_fails_at_start_in_one_line(six, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--data", six, "--val-data", six, "--val-data", f"held={tmp_path}/no-such-dev",
               "--out", str(out), "--max-steps", "3", *[x for s in SMALL for x in ("--set", s)]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"validation set 'held' cannot be opened: {tmp_path}/no-such-dev" in err and "--val-data" in err
    assert not out.exists()  # stopped before the run folder, the model or a single step


def _heldout_on_s3(speech_corpus: Path, tmp: Path, s3, n: int = 4) -> str:
    """Utterances 6..6+n of the corpus (not trained on), packed straight to `s3://.../dev/shards`."""
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    tsv = tmp / "heldout.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(speech_corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[7 : 7 + n]]) + "\n")
    url = f"{s3.make_bucket('valsets')}/dev/shards"
    pack(PackConfig(input=str(tsv), output=url, max_samples_per_shard=2, progress=False,
                    storage_options=s3.storage_options))
    return url


@pytest.fixture(scope="module")
def heldout(speech_corpus, tmp_path_factory, s3) -> str:
    return _heldout_on_s3(speech_corpus, tmp_path_factory.mktemp("heldout"), s3)


def _val_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]


def _pooled(row: dict, names: list[str], rate: str, weight: str) -> float:
    return sum(row[f"val/{n}/{rate}"] * row[f"val/{n}/{weight}"] for n in names) / sum(
        row[f"val/{n}/{weight}"] for n in names)


@pytest.mark.s3
def test_two_validation_sets_report_their_own_cer_wer(six, heldout, s3, tmp_path, caplog):
    """Train on six utterances; validate on those six (local) and on four others (S3) at steps 30 and 60."""
    caplog.set_level("INFO", logger="shardtrain.train")
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={six}", f"train.val_data_url={six}", f"train.val_extra_urls={heldout}",
        f"train.out_dir={tmp_path}", "train.max_steps=60", "train.val_every_steps=30", "train.log_every_steps=30"])
    res = train(cfg, World(), storage_options=s3.storage_options)
    names = [f"{Path(six).parent.name}-shards", "dev-shards"]  # both end in /shards: parents tell them apart
    vals = _val_rows(tmp_path)
    assert [r["step"] for r in vals] == [30, 60]
    for row in vals:
        assert {f"val/{n}/{k}" for n in names for k in PER_SET} <= set(row), sorted(row)
        assert [row[f"val/{n}/utts"] for n in names] == [6, 4] and row[f"val/{names[0]}/skipped"] == 0
        for n in names:
            assert 0 <= row[f"val/{n}/cer"] <= 2 and 0 <= row[f"val/{n}/wer"] <= 2 and row[f"val/{n}/loss"] > 0
        # the pooled figures are the per-set ones weighted by reference characters / words / target tokens
        assert row["cer"] == pytest.approx(_pooled(row, names, "cer", "chars"), rel=1e-9)
        assert row["wer"] == pytest.approx(_pooled(row, names, "wer", "words"), rel=1e-9)
        assert row["val_loss"] == pytest.approx(_pooled(row, names, "loss", "tokens"), rel=1e-9)
    seen, unseen = (vals[-1][f"val/{n}/cer"] for n in names)
    assert seen < unseen and vals[-1][f"val/{names[0]}/loss"] < vals[-1][f"val/{names[1]}/loss"]
    assert res["cer"] == vals[-1]["cer"] and res[f"val/{names[1]}/wer"] == vals[-1][f"val/{names[1]}/wer"]
    logged = caplog.text
    assert all(f"step 60: {n}  val_loss" in logged and f"{n} ref: " in logged for n in names)
    assert "all 2 sets (pooled)" in logged
    meta = json.loads((tmp_path / "checkpoints" / "step_000060" / "meta.json").read_text())
    assert meta["val_loss"] == vals[-1]["val_loss"]  # best-checkpoint selection reads the pooled loss


@pytest.mark.s3
def test_unopenable_s3_validation_set_fails_before_training(six, s3, tmp_path):
    missing = f"{s3.make_bucket('valsets-missing')}/dev"
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={six}", f"train.val_data_url={six}", f"train.val_extra_urls={missing}",
        f"train.out_dir={tmp_path / 'run'}", "train.max_steps=3"])
    with pytest.raises(DatasetError, match=f"validation set 'dev' cannot be opened: {missing}"):
        train(cfg, World(), storage_options=s3.storage_options)
    assert not (tmp_path / "run").exists()


@pytest.mark.s3
@pytest.mark.slow
def test_two_ranks_evaluate_their_stripes_of_each_set(six, heldout, s3, tmp_path):
    """torchrun, 2 gloo processes, same global batch as one process: every set's utterances are counted once over
    the ranks and the per-set losses match the one-process run's."""
    steps = ["train.max_steps=3", "train.val_every_steps=0", "train.log_every_steps=1"]
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + steps + [
        f"train.data_url={six}", f"train.out_dir={tmp_path / 'one'}"])
    cfg = apply_overrides(cfg, [f"train.val_data_url={six}", f"train.val_extra_urls={heldout}"])
    train(cfg, World(), storage_options=s3.storage_options)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "shardtrain",
           "train", "--data", six, "--val-data", f"seen={six}", "--val-data", f"held={heldout}", "--out",
           str(tmp_path / "two"), *[x for s in SMALL + steps for x in ("--set", s)],
           *[x for k, v in s3.storage_options.items() for x in ("--storage-option", f"{k}={json.dumps(v)}")]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    (one,), (two,) = _val_rows(tmp_path / "one"), _val_rows(tmp_path / "two")
    for n1, n2 in ((f"{Path(six).parent.name}-shards", "seen"), ("dev-shards", "held")):
        for k in ("utts", "chars", "words", "tokens", "skipped"):
            assert two[f"val/{n2}/{k}"] == one[f"val/{n1}/{k}"], (k, one, two)
        assert two[f"val/{n2}/loss"] == pytest.approx(one[f"val/{n1}/loss"], rel=2e-3)
        assert two[f"val/{n2}/cer"] == pytest.approx(one[f"val/{n1}/cer"], abs=0.02)
    assert [two["val/seen/utts"], two["val/held/utts"]] == [6, 4]
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=2e-3)
