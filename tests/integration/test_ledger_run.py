"""`shardtrain ledger` on real runs: killed, resumed, re-sized under torchrun (gloo, CPU), and a weighted mixture.

The ledger is written by default with every checkpoint; these tests read it only through the CLI, as a user would.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import shardtrain_cli_many
from shardtrain.pack.packer import PackConfig, pack

pytestmark = pytest.mark.slow

SMALL = ["model.d_model=32", "model.num_layers=1", "model.dropout=0", "train.augment=false", "train.warmup_steps=0",
         "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1", "stream.bucket.max_batch_size=1",
         "train.tensorboard=false", "train.log_every_steps=1", "train.ckpt_every_steps=2", "train.cpu_threads=1"]


def _train(nproc: int | None, data: list[str], out: Path, max_steps: int, resume: bool, extra=(), env=None,
           ok: bool = True) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "shardtrain"] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "shardtrain"]
    args = ["train", "--pipeline", "tiny_cpu", "--max-steps", str(max_steps), "--out", str(out)]
    for d in data:
        args += ["--data", d]
    args += ["--resume"] if resume else []
    for s in SMALL + list(extra):
        args += ["--set", s]
    res = subprocess.run(launcher + args, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if ok:
        assert res.returncode == 0, res.stderr[-4000:]
    return res


def _ledger(out: Path, *args: str) -> tuple[int, dict, str]:
    res = subprocess.run([sys.executable, "-m", "shardtrain", "ledger", str(out), "--json", *args],
                         capture_output=True, text=True, timeout=120)
    return res.returncode, json.loads(res.stdout), res.stderr


def _pack(speech_corpus, tmp_path, name: str, lines: slice) -> str:
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    tsv = tmp_path / f"{name}.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(speech_corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[lines]]) + "\n")
    pack(PackConfig(input=str(tsv), output=str(tmp_path / name), max_samples_per_shard=3, progress=False))
    return str(tmp_path / name)


def test_killed_resumed_resized_run_trains_every_utterance_once(speech_corpus, tmp_path):
    data = _pack(speech_corpus, tmp_path, "d", slice(1, 13))  # 12 utterances, one per batch
    out = tmp_path / "run"
    # 2 ranks: checkpoint at step 2, killed after step 3 (step 3 is trained again by the resume)
    killed = _train(2, [data], out, max_steps=6, resume=False, ok=False,
                    env={"SHARDTRAIN_FAULTS": "train.step.rank0=3:kill"})
    assert killed.returncode != 0
    _train(None, [data], out, max_steps=4, resume=True)     # 1 rank: steps 3-4 (checkpoint 2 -> 4)
    _train(3, [data], out, max_steps=7, resume=True)        # 3 ranks: the rest of epoch 0, into epoch 1

    key = pq.read_table(Path(data) / "index.parquet", columns=["key"]).column("key")[0].as_py()
    whole, one_key = shardtrain_cli_many(["ledger", str(out), "--json"],  # one interpreter for both reads
                                         ["ledger", str(out), "--json", "--key", key, "--epoch", "0"])
    code, rep, err = whole.returncode, json.loads(whole.stdout), whole.stderr
    assert code == 0, err
    assert [(a["start_step"], a["world_size"]) for a in rep["attempts"]] == [(0, 2), (2, 1), (4, 3)]
    # the kill after step 3 (checkpoint 2) wasted step 3 (2 ranks x 1 utterance), trained again
    assert rep["redone"]["steps"] == 1 and rep["redone"]["audio_s"] > 0
    e0 = rep["epochs"][0]
    assert e0["epoch"] == 0 and e0["complete"] and e0["exactly_once"]
    (d,) = e0["datasets"]
    assert (d["planned"], d["trained"], d["once"], d["never"], d["more_than_once"]) == (12, 12, 12, 0, 0)
    assert any(e["epoch"] == 1 for e in rep["epochs"])

    rep = json.loads(one_key.stdout)
    hits = [h for h in rep["keys"][key] if h["epoch"] == 0]
    assert len(hits) == 1 and hits[0]["rank"] in (0, 1, 2)

    # a deliberately duplicated step: a rank file of the last attempt (one that trained rows of epoch 0) written
    # again as a later step
    folder = out / "ledger"
    files = sorted(folder.glob(f"a{rep['attempts'][-1]['attempt']}-r*-s*.npz"))
    for last in files:
        with np.load(last) as z:
            steps, rows, sources = z["steps"].copy(), z["rows"], z["sources"]
        if len(rows) and steps[0, 1] == 0:
            break
    assert len(rows), "no rank file of the last attempt trained a row"
    steps[:, 0] += 100
    buf = io.BytesIO()
    np.savez(buf, steps=steps, rows=rows, sources=sources)
    (folder / (last.name.rsplit("-s", 1)[0] + f"-s{int(steps[-1, 0]):09d}.npz")).write_bytes(buf.getvalue())
    code, rep, err = _ledger(out)
    assert code == 1 and "exactly-once broken" in err
    broken = [e for e in rep["epochs"] if not e["exactly_once"]]
    assert broken and broken[0]["datasets"][0]["over_plan_count"] >= 1


def test_mixture_ledger_shares_follow_the_weights(speech_corpus, tmp_path):
    """`--data A --data B --weight 1 --weight 3`, one process: the ledger's audio shares and metrics.jsonl's audio
    seconds per dataset both follow the weights (one run for both: it was two runs in two modules)."""
    a = _pack(speech_corpus, tmp_path, "a", slice(1, 11))
    b = _pack(speech_corpus, tmp_path, "b", slice(11, 16))
    out = tmp_path / "run"
    cmd_extra = ["stream.bucket.max_batch_size=4"]
    res = subprocess.run([sys.executable, "-m", "shardtrain", "train", "--data", a, "--data", b, "--weight", "1",
                          "--weight", "3", "--pipeline", "tiny_cpu", "--max-steps", "12", "--out", str(out)]
                         + [x for s in SMALL[:-1] + cmd_extra for x in ("--set", s)],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    code, rep, err = _ledger(out)
    assert code == 0, err  # b repeats inside an epoch by its weight: planned, not a violation
    e0 = rep["epochs"][0]
    assert e0["complete"] and e0["exactly_once"]
    da, db = e0["datasets"]
    assert db["more_than_once"] > 0 and db["over_plan_count"] == 0
    assert abs(db["share"] - 0.75) < 0.2 and abs(da["share"] - 0.25) < 0.2
    # the trainer's own count agrees: metrics.jsonl carries the audio seconds per dataset (so far, over ranks)
    last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in x][-1]
    a_s, b_s = last["audio_s/d0"], last["audio_s/d1"]
    assert a_s > 0 and b_s > 0 and 1.5 < b_s / a_s < 6, (a_s, b_s)  # 1:3 by audio, up to a batch of quantisation
