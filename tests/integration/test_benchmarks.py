"""The comparison benchmark runs end to end (smoke size): every loader, both storages, a table, JSON and a plot.

Speed is not asserted here (benchmarks report it); what is asserted is that each tool really read the whole
corpus, so a broken peer pipeline or a loader that silently drops samples fails this test.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.s3]

ROOT = Path(__file__).resolve().parents[2]


def test_compare_quick_runs_every_tool_on_every_storage(tmp_path):
    # tones, not espeak-ng speech: what is asserted (every tool reads every sample) does not depend on the audio,
    # and 80 tones still make 2 shards for the peers' 2 DataLoader workers (~10 s less than 120 speech utterances)
    cmd = [sys.executable, "-m", "benchmarks.load.compare", "--quick", "--corpus", "tone", "--utterances", "80",
           "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    n = result["dataset"]["samples"]
    assert n == 80 and result["dataset"]["shards"] >= 2
    rows = {(r["tool"], r["storage"], r["workers"]): r for r in result["rows"]}
    for storage in ("local", "s3"):  # the peers with their DataLoader workers, shardtrain with its decode threads
        for tool in ("webdataset", "lhotse"):
            assert (tool, storage, 2) in rows, f"missing {tool} on {storage}"
        assert ("shardtrain", storage, 0) in rows, f"missing shardtrain on {storage}"
    assert not any(tool == "shardtrain" and workers for tool, _, workers in rows)  # there are no loader workers
    for (tool, storage, workers), r in rows.items():
        assert r["samples_per_s"]["median"] > 0 and r["audio_s_per_s"]["median"] > 0
    runs = [json.loads(line) for line in (tmp_path / "out" / "compare.jsonl").read_text().splitlines()]
    for r in runs:
        if r["tool"] in ("shardtrain", "webdataset", "lhotse") or r["tool"].startswith("decode-limit"):
            assert r["samples"] == n, f"{r['tool']} on {r['storage']} read {r['samples']} of {n} samples"
    assert {r["tool"] for r in runs} >= {"decode-limit-soundfile", "decode-limit-libsndfile", "decode-limit-decode_into"}
    figures = result["issue_table"]["storages"]["local"]  # both ceilings: libsndfile's (the issue's) and the fastest
    assert figures["loader whole epoch / decode-only limit (libsndfile)"] > 0
    assert figures["loader whole epoch / decode-only limit (fastest decoder, dr_flac)"] > 0
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    assert "| shardtrain |" in (tmp_path / "out" / "compare.md").read_text()


def test_bench_decode_compares_the_decoders(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.format.bench_decode", "--utterances", "60", "--shards", "1",
           "--repeats", "1", "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "bench_decode.json").read_text())
    assert result["members"] > 0 and result["audio_seconds"] > 0
    seen = {(r["decoder"], r["parallelism"].split()[1]) for r in result["rows"] if r["audio_s_per_s"]["median"] > 0}
    decoders = ("soundfile BytesIO", "libsndfile on a memfd", "decode_into (dr_flac)")
    assert seen == {(d, how) for d in decoders for how in ("threads", "processes")}
    cpu = result["cpu_ab"]  # dr_flac against libsndfile, measured in thread CPU time
    assert cpu["dr_flac"] > 0 and cpu["libsndfile"] > 0
    assert cpu["dr_flac_vs_libsndfile"] == cpu["dr_flac"] / cpu["libsndfile"]


def test_compare_measures_a_dataset_already_packed(tone_corpus, tmp_path):
    """--dataset: the loader and webdataset on the user's packed dataset (no corpus, so no lhotse), every sample read."""
    from conftest import pack_subset

    ds = pack_subset(tone_corpus, tmp_path / "given", 8)
    cmd = [sys.executable, "-m", "benchmarks.load.compare", "--dataset", ds, "--storage", "local", "--repeats", "1",
           "--workers", "1", "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "lhotse needs the source corpus" in res.stderr
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert result["dataset"]["samples"] == 8
    assert {r["tool"] for r in result["rows"]} == {"shardtrain", "webdataset"}
    runs = [json.loads(line) for line in (tmp_path / "out" / "compare.jsonl").read_text().splitlines()]
    assert all(r["samples"] == 8 for r in runs if r["tool"] in ("shardtrain", "webdataset"))
    res = subprocess.run([sys.executable, "-m", "benchmarks.load.compare", "--dataset", str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode != 0 and "no manifest.json there" in res.stderr


def test_peers_count_audio_seconds_at_the_dataset_rate(tmp_path, monkeypatch):
    """An 8 kHz dataset: webdataset, the decode limit and the loader each report the audio the manifest holds
    (a fixed 16 kHz gave the peers and the ceiling half of it, every ratio against them off by 2x); a peer that
    decodes at another rate than the dataset's fails instead of counting wrong seconds."""
    from conftest import pack_tones
    from shardtrain.pack.packer import AudioTarget

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import common
    from benchmarks.load import bench_loader

    ds = Path(pack_tones(tmp_path, [1.0 + 0.25 * i for i in range(12)], 0, max_samples_per_shard=6,
                         audio=AudioTarget(sample_rate_hz=8000)))
    total = json.loads((ds / "manifest.json").read_text())["totals"]["seconds"]
    assert common.dataset_rate(ds) == common.dataset_summary(ds)["sample_rate_hz"] == 8000
    shards = common.shard_paths(ds)
    runs = {"webdataset": bench_loader.run_webdataset(shards, 0, 4, sample_rate_hz=8000),
            "shardtrain": bench_loader.run_shardtrain(str(ds), 0, 30.0)}
    for decoder in ("soundfile", "libsndfile", "decode_into"):
        runs[decoder] = bench_loader.run_decode_limit(shards, 1, decoder=decoder)
    for name, r in runs.items():
        assert r["samples"] == 12 and r["audio_seconds"] == pytest.approx(total, abs=1e-3), name
    with pytest.raises(ValueError, match="8000 Hz in a dataset of 16000 Hz"):
        bench_loader.run_webdataset(shards, 0, 4, sample_rate_hz=16000)


def test_the_webdataset_peer_reads_a_pack_of_another_codec(tmp_path, monkeypatch):
    """A WAV pack: the peer decodes its `wav` members (it read only `flac` and died with KeyError: 'flac')."""
    from conftest import pack_tones
    from shardtrain.pack.packer import AudioTarget

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.load import bench_loader

    ds = Path(pack_tones(tmp_path, [1.0, 1.5, 2.0], 0, audio=AudioTarget(codec="wav")))
    total = json.loads((ds / "manifest.json").read_text())["totals"]["seconds"]
    r = bench_loader.run_webdataset([str(p) for p in sorted(ds.glob("*.tar"))], 0, 2, sample_rate_hz=16000)
    assert r["samples"] == 3 and r["audio_seconds"] == pytest.approx(total, abs=1e-3)


def test_ratios_against_shardtrain_need_a_shardtrain_run(monkeypatch):
    """`--tools webdataset lhotse`: no shardtrain run, so no "shardtrain / this" ratio (it read 1.00, a peer's
    median over itself)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import common
    from benchmarks.load import bench_loader

    run = {"audio_s_per_s": 100.0, "samples_per_s": 10.0, "audio_seconds": 50.0, "batches": 5}
    lim = common.aggregate([{"audio_s_per_s": 400.0, "samples_per_s": 40.0}])
    limit = {**lim, "libsndfile": lim, "by_decoder": {}, "one_process": lim}
    _, summary = bench_loader.rows_for_table({("webdataset", "local", 2): [run]}, limit, ref_workers=0)
    assert summary[0]["shardtrain_over_tool"] is None and summary[0]["vs_shardtrain"] is None
    assert summary[0]["of_decode_limit"] == 0.25
    _, summary = bench_loader.rows_for_table({("webdataset", "local", 2): [run], ("shardtrain", "local", 0):
                                              [{**run, "audio_s_per_s": 300.0}]}, limit, ref_workers=0)
    assert {r["tool"]: r["shardtrain_over_tool"] for r in summary} == {"webdataset": 3.0, "shardtrain": 1.0}


def test_bench_tune_counts_every_micro_batch_of_an_accumulated_step(tmp_path, monkeypatch):
    """bench_tune's audio per step sums the key log's lines of a step (one per loader batch): with 2-step
    accumulation a step holds about twice one batch's audio (it kept only the step's last line: x1), while fill and
    padding stay per loader batch."""
    from conftest import pack_tones

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.train.bench_tune import train_run

    ds = pack_tones(tmp_path, [1.0 + 0.05 * i for i in range(40)], 0)
    runs = {k: train_run(ds, tmp_path / f"run{k}", 6, 1000.0, [f"train.grad_accum_steps={k}",
                                                                "stream.bucket.max_batch_seconds=8"])
            for k in (1, 2)}
    assert runs[1]["steps"] == runs[2]["steps"] == 4  # the first two steps are left out as warm-up
    assert 1.6 < runs[2]["audio_per_step_s"] / runs[1]["audio_per_step_s"] < 2.4
    assert runs[2]["fill"] == pytest.approx(runs[1]["fill"], abs=0.2)
