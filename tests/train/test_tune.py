"""Per-bucket batch budgets: `shardtrain tune` on the CPU, training with the table (exactly once, exact resume),
the closed loop between epochs, and an out-of-memory step redone in halves (one process; the two-rank torchrun
case is tests/integration/test_oom_torchrun.py). Real packed espeak-ng speech, the real trainer."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import pack_subset
from pipelines import load_pipeline
from shardtrain import faults
from shardtrain.cli.app import main
from shardtrain.train.budget import BudgetConfig, adapt, bucket_of, read_budget, write_budget
from shardtrain.train.overrides import apply_overrides
from shardtrain.train.loop import train
from shardtrain.train.tune import largest_fit
from shardtrain.world import World

SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=20", "stream.bucket.max_batch_seconds=12", "train.tensorboard=false",
         "train.progress=false", "train.cpu_threads=1", "train.log_every_steps=1", "train.val_every_steps=0",
         "train.log_keys=true"]
TABLE = [[2.5, 9.0], [4.5, 11.0], [6.0, 14.0]]


@pytest.fixture(scope="module")
def data(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("twenty"), 20)


@pytest.fixture(scope="module")
def durations(data) -> dict[str, float]:
    t = pq.read_table(Path(data) / "index.parquet", columns=["key", "duration_s"]).to_pylist()
    return {r["key"]: r["duration_s"] for r in t}


def run(data: str, out: Path, steps: int, *extra: str, resume: bool = False) -> dict:
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={data}", f"train.out_dir={out}", f"train.max_steps={steps}", *extra])
    return train(cfg, World(), resume=resume)


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows(out) if "loss" in r]


def key_lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "keys" / "rank00000.jsonl").read_text().splitlines()]


def budget_file(tmp_path: Path, table=TABLE) -> str:
    path = tmp_path / "budget.json"
    write_budget(path, {"budget_table": table, "memory_target_bytes": 1 << 40, "device": "cpu", "buckets": []})
    return str(path)


@pytest.mark.slow  # a long run (15-25 s on 2 busy cores): the full suite, not the fast tier
def test_tune_on_cpu_writes_one_budget_per_bucket_larger_for_short_ones(data, tmp_path, capsys):
    out = tmp_path / "budget.json"
    assert main(["tune", "--data", data, "--pipeline", "tiny_cpu", "--out", str(out), "--device", "cpu",
                 "--memory-limit-mb", "110", "--buckets", "3", "--set", "train.cpu_threads=1",
                 "--set", "stream.bucket.padded_budget=true"]) == 0
    doc = read_budget(out)
    table, buckets = doc["budget_table"], doc["buckets"]
    assert len(table) == len(buckets) == 3 and doc["memory_target_bytes"] == 110 * 2**20
    assert table[-1][0] == pytest.approx(max(pq.read_table(Path(data) / "index.parquet").column("duration_s")
                                             .to_pylist()), abs=1e-3)  # the last edge covers the longest row
    assert table[0][1] > table[-1][1], table  # short utterances: more audio per batch in the same memory
    assert [b["utterances"] for b in buckets] == sorted((b["utterances"] for b in buckets), reverse=True)
    assert all(0 < b["peak_bytes"] <= doc["memory_target_bytes"] and b["step_s"] > 0 for b in buckets)
    assert "bucket <= s" in capsys.readouterr().out


def test_largest_fit_gallops_from_a_start_then_bisects():
    calls: list[int] = []
    n, probes = largest_fit(lambda k: calls.append(k) or k <= 37, 1000)
    assert n == 37 and probes == len(calls) and calls[:7] == [1, 2, 4, 8, 16, 32, 64] and probes <= 13
    calls.clear()
    assert largest_fit(lambda k: calls.append(k) or k <= 37, 1000, start=40)[0] == 37
    assert calls[:2] == [40, 20] and len(calls) <= 7  # a good start (the previous bucket's) saves probes
    for n_max, limit, start in [(3, 5, 1), (8, 0, 4), (50, 49, 50), (50, 1, 7), (9, 9, 1)]:
        assert largest_fit(lambda k: k <= limit, n_max, start)[0] == min(limit, n_max)


def test_adapt_tightens_near_the_limit_loosens_far_below_and_stays_in_bounds():
    cfg = BudgetConfig()
    table = ((2.0, 20.0), (4.0, 10.0), (6.0, 8.0), (8.0, 4.0))
    mb = 2.0**20
    peaks = [99 * mb, 40 * mb, 80 * mb, math.inf]  # limit 100 MB, 10 MB fixed
    new, moves = adapt(table, table, peaks, 100 * mb, 10 * mb, cfg)
    assert new[0][1] < 20.0 and new[1][1] > 10.0 and new[2][1] == 8.0 and new[3][1] == 2.0
    assert new[1][1] <= 10.0 * cfg.max_step and {m.bucket for m in moves} == {0, 1, 3}
    # bounds: never below min_scale x tuned, never above max_scale x tuned
    low, _ = adapt(((2.0, 5.1),), ((2.0, 20.0),), [math.inf], 100 * mb, 0.0, cfg)
    assert low[0][1] == 20.0 * cfg.min_scale
    unseen, none = adapt(table, table, [-1.0] * 4, 100 * mb, 10 * mb, cfg)
    assert unseen == table and none == []
    assert [bucket_of(table, d) for d in (0.5, 2.0, 2.01, 7.9, 30.0)] == [0, 0, 1, 3, 3]


def test_training_with_the_table_plans_each_bucket_to_its_budget_exactly_once_and_resumes_exactly(
        data, durations, tmp_path, monkeypatch):
    budget = budget_file(tmp_path)
    extra = ["budget.file=" + budget, "train.ckpt_every_steps=4", "budget.adapt=false"]  # the table as written
    run(data, tmp_path / "a", 14, *extra)
    lines = key_lines(tmp_path / "a")
    epoch0 = [k for ln in lines if ln["epoch"] == 0 for k in ln["keys"]]
    assert sorted(epoch0) == sorted(durations)  # every utterance once in the epoch, none lost to the table
    for ln in lines:  # each batch within the budget of its longest utterance
        d = [durations[k] for k in ln["keys"]]
        assert sum(d) <= TABLE[bucket_of(tuple(map(tuple, TABLE)), max(d))][1] + 1e-6, ln  # type: ignore[arg-type]
    assert any(ln["epoch"] == 1 for ln in lines), "the run must cross an epoch"
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["stream"]["bucket"]["budget_table"] == TABLE and cfg["budget"]["file"] == budget
    monkeypatch.setenv(faults.ENV, "train.step.rank0=9")
    with pytest.raises(faults.InjectedFault):
        run(data, tmp_path / "b", 14, *extra)
    run(data, tmp_path / "b", 14, *extra, resume=True)
    assert losses(tmp_path / "b") == losses(tmp_path / "a")  # bit-exact across the crash


def test_closed_loop_moves_budgets_between_epochs_under_a_memory_limit(data, durations, tmp_path, monkeypatch):
    budget = budget_file(tmp_path)
    steps = 14
    run(data, tmp_path / "free", 12, "budget.file=" + budget, "budget.memory_limit_mb=100000")
    [free] = [r for r in rows(tmp_path / "free") if r.get("event") == "budget"]
    assert free["epoch"] == 1 and all(m["new_s"] > m["old_s"] for m in free["moves"]) and free["moves"]
    peaks = [p for p in free["peak_mb"] if p is not None]
    tight = ["budget.file=" + budget, f"budget.memory_limit_mb={min(peaks) * 0.8:.3f}", "train.ckpt_every_steps=4"]
    run(data, tmp_path / "tight", steps, *tight)
    [ev] = [r for r in rows(tmp_path / "tight") if r.get("event") == "budget"]
    assert ev["moves"] and all(m["new_s"] < m["old_s"] and m["why"] == "near the limit" for m in ev["moves"])
    new = [tuple(r) for r in ev["table"]]
    lines = key_lines(tmp_path / "tight")
    epoch1 = [ln for ln in lines if ln["epoch"] == 1]
    assert epoch1 and all(sum(durations[k] for k in ln["keys"])
                          <= new[bucket_of(tuple(new), max(durations[k] for k in ln["keys"]))][1] + 1e-6
                          for ln in epoch1)  # the next epoch is planned to the moved table
    epoch0 = sorted(k for ln in lines if ln["epoch"] == 0 for k in ln["keys"])
    assert epoch0 == sorted(durations)
    ck = json.loads((tmp_path / "tight" / "config.json").read_text())
    assert ck["stream"]["bucket"]["budget_table"] == TABLE  # config.json is the starting point
    # crashes: at the boundary's step (resumed from a checkpoint before it: the epoch's peaks come back from the
    # checkpoint and the same decision is taken again), and after it (the moved table comes from the checkpoint)
    boundary = ev["step"]
    assert 4 < boundary < 13
    monkeypatch.setenv(faults.ENV, f"train.step.rank0={boundary},train.step.rank0=13")
    for _ in range(2):
        with pytest.raises(faults.InjectedFault):
            run(data, tmp_path / "again", steps, *tight, resume=(tmp_path / "again").exists())
    run(data, tmp_path / "again", steps, *tight, resume=True)
    assert losses(tmp_path / "again") == losses(tmp_path / "tight")
    assert [r for r in rows(tmp_path / "again") if r.get("event") == "budget"] == [ev]


def test_injected_oom_is_redone_in_halves_with_the_same_losses(data, tmp_path, monkeypatch):
    extra = ["stream.bucket.num_buckets=2", "train.ckpt_every_steps=0"]
    run(data, tmp_path / "a", 6, *extra)
    monkeypatch.setenv(faults.ENV, "train.step.rank0=3:oom")
    res = run(data, tmp_path / "b", 6, *extra)
    [ev] = [r for r in rows(tmp_path / "b") if r.get("event") == "oom_split"]
    step3 = [ln for ln in key_lines(tmp_path / "b") if ln["step"] == 3]
    assert ev["step"] == 3 and ev["ranks"] == [0] and ev["parts"] == 2 and res["oom_splits"] == 1
    assert ev["samples"] == sum(len(ln["keys"]) for ln in step3) > 1  # the whole batch, redone
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [s for s, _ in lb] == [1, 2, 3, 4, 5, 6]
    for (sa, a), (sb, b) in zip(la, lb):
        assert sa == sb and b == pytest.approx(a, rel=1e-5, abs=1e-6), (la, lb)
    ma = torch.load(next((tmp_path / "a" / "checkpoints").glob("step_*")) / "model.pt", weights_only=True)
    mb = torch.load(next((tmp_path / "b" / "checkpoints").glob("step_*")) / "model.pt", weights_only=True)
    # Adam normalises each update, so a parameter with a near-zero gradient can move by up to ~lr on rounding
    # noise alone: compare against the step size, not bitwise
    assert max(float((ma[k] - mb[k]).abs().max()) for k in ma) < 3e-4


def test_oom_fault_action_fires_only_where_a_point_accepts_it(monkeypatch, tmp_path):
    from shardtrain.train.memory import is_oom

    monkeypatch.setenv(faults.ENV, "train.step.rank0=5:oom")
    faults.point("train.step.rank0", 5)  # the after-step point (raise/kill) ignores an oom entry
    with pytest.raises(torch.OutOfMemoryError, match="injected") as e:
        faults.point("train.step.rank0", 5, actions=("oom",), once_marker=tmp_path / "m")
    assert is_oom(e.value) and is_oom(RuntimeError("CUDA error: out of memory")) and not is_oom(RuntimeError("x"))
    faults.point("train.step.rank0", 5, actions=("oom",), once_marker=tmp_path / "m")  # fired once
    monkeypatch.setenv(faults.ENV, "train.step.rank0=5:explode")
    with pytest.raises(ValueError, match="raise\\|kill\\|oom"):
        faults.point("train.step.rank0", 5)


def test_tune_exits_non_zero_in_one_line_when_one_utterance_does_not_fit(data, tmp_path, capsys):
    out = tmp_path / "budget.json"
    assert main(["tune", "--data", data, "--pipeline", "tiny_cpu", "--out", str(out), "--device", "cpu",
                 "--memory-limit-mb", "1", "--buckets", "3", "--set", "train.cpu_threads=1"]) == 1
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if "error" in x.lower() or "WARNING" in x]
    assert len(errors) == 1 and errors[0].startswith("tune: error: one utterance of"), err
    assert "--memory-limit-mb" in errors[0] and not out.exists()


def test_tune_defaults_search_a_small_multiple_of_the_preset_and_log_every_probe(data, tmp_path, capfd):
    from shardtrain.train.tune import CPU_SEARCH_MULTIPLE, default_search_s

    cfg = apply_overrides(load_pipeline("tiny_cpu"), ["stream.bucket.max_batch_seconds=12"])
    assert default_search_s(cfg, torch.device("cpu")) == CPU_SEARCH_MULTIPLE * 12
    out = tmp_path / "budget.json"
    assert main(["tune", "--data", data, "--pipeline", "tiny_cpu", "--out", str(out), "--device", "cpu",
                 "--buckets", "2", "--set", "train.cpu_threads=1", "--set", "stream.bucket.max_batch_seconds=12"]) == 0
    doc = read_budget(out)
    assert all(b <= CPU_SEARCH_MULTIPLE * 12 + 1e-6 for _, b in doc["budget_table"]), doc["budget_table"]
    probes = [x.split("INFO shardtrain.train.tune: ")[1] for x in capfd.readouterr().err.splitlines()
              if "INFO shardtrain.train.tune: tune bucket" in x]
    assert probes and all("utterances, peak" in m and "MiB" in m for m in probes), probes
    assert {m.split(" (")[0] for m in probes} == {"tune bucket 1/2", "tune bucket 2/2"}
