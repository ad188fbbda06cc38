"""`pack --engine ray` on a real Ray cluster (ray.init(num_cpus=2), started once for this module): byte-identical to
the local engine for dir, TSV and LibriSpeech inputs with bad items, a worker SIGKILLed mid-task and retried, a
driver SIGKILLed mid-run and recovered by re-running, and S3 in and out (the real loopback server)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain import faults
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus, synth_wave
from conftest import dataset_sha256s

pytestmark = pytest.mark.slow

KILLED_SHARD = 9
"""The cluster's workers run with SHARDTRAIN_FAULTS="pack.shard=9:kill": the worker that first starts shard 9 of
any layout SIGKILLs itself (once per layout, marker in the temp folder). test_worker_killed_mid_task_is_retried lays out
10 shards and checks that it fired; the driver-kill test's re-run may cross it too; the rest lay out fewer shards."""


def _fault_marker(out: Path) -> Path:
    fp = json.loads((out / "manifest.json").read_text())["fingerprint"]
    return Path(tempfile.gettempdir()) / f"shardtrain-fault-{fp[:16]}-pack.shard-{KILLED_SHARD}"


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module (2 CPUs); its address, for drivers started as subprocesses."""
    import ray  # the [test] extra installs it (shardtrain[ray])

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {faults.ENV: f"pack.shard={KILLED_SHARD}:kill",
                                       "AWS_DEFAULT_REGION": "us-east-1"}})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _pack(src, out, engine: str, **kw):
    kw.setdefault("max_samples_per_shard", 4)
    kw.setdefault("part_items", 5)  # several parts per input, so scan tasks run in parallel and finish out of order
    return pack(PackConfig(input=str(src), output=str(out), engine=engine, progress=False, **kw))



def _dir_input(root: Path) -> Path:
    d = make_corpus(root, [0.3 + 0.17 * (i * 7 % 11) for i in range(14)], seed=11)
    (d / "utt-00003.txt").unlink()  # missing_transcript
    (d / "utt-00005.txt").write_text("  \n")  # empty_transcript
    (d / "garbage.flac").write_bytes(b"not audio" * 50)  # unreadable_audio
    (d / "garbage.txt").write_text("garbage")
    full = (d / "utt-00007.flac").read_bytes()
    (d / "trunc.flac").write_bytes(full[: len(full) // 2])  # truncated: rejected by the probe or the decode check
    (d / "trunc.txt").write_text("truncated")
    for name in ("manifest.tsv", "manifest.jsonl"):
        (d / name).unlink()
    return d


def _tsv_input(root: Path) -> Path:
    d = make_corpus(root / "audio", [0.4 + 0.21 * (i * 5 % 13) for i in range(16)], seed=12)
    lines = ["id\tpath\ttext\tspeaker"]
    for i in range(16):
        lines.append(f"u.{i}/x\t{d}/utt-{i:05d}.flac\twords {i}\tspk{i % 3}")  # ids that need sanitising
    lines += [f"u.3/x\t{d}/utt-00004.flac\tduplicate\tspk0", f"gone\t{d}/nope.flac\tmissing\tspk1",
              f"u_3_x\t{d}/utt-00006.flac\tkey collision\tspk2", "short\trow"]
    path = root / "in.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _librispeech_input(root: Path) -> Path:
    for spk, chapter in (("19", "198"), ("26", "495"), ("32", "21")):
        d = root / spk / chapter
        d.mkdir(parents=True)
        lines = []
        for u in range(5):
            utt = f"{spk}-{chapter}-{u:04d}"
            sf.write(d / f"{utt}.flac", synth_wave(0.3 + 0.2 * ((u * 3 + int(spk)) % 7), 16000, seed=int(spk) + u),
                     16000)
            lines.append(f"{utt} WORDS FOR {utt}")
        lines.append(f"{spk}-{chapter}-0099 NO AUDIO")  # missing_audio
        (d / f"{spk}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    sf.write(root / "19" / "198" / "19-198-0042.flac", np.zeros(800, np.int16), 16000)  # missing_transcript
    return root


@pytest.mark.parametrize("fmt", ["dir", "tsv", "librispeech"])
def test_ray_output_is_byte_identical_to_local(cluster, fmt, tmp_path):
    src = {"dir": _dir_input, "tsv": _tsv_input, "librispeech": _librispeech_input}[fmt](tmp_path / "in")
    local = _pack(src, tmp_path / "local", "local", part_items=1000)
    on_ray = _pack(src, tmp_path / "ray", "ray")
    a, b = dataset_sha256s(tmp_path / "local"), dataset_sha256s(tmp_path / "ray")
    assert a == b
    assert {"index.parquet", "manifest.json", "rejects.jsonl", "shard-000000.tar"} <= set(a)
    assert (on_ray.samples, on_ray.shards, on_ray.rejects) == (local.samples, local.shards, local.rejects)
    assert local.shards < KILLED_SHARD + 1 and local.samples >= 12 and local.rejects >= 2, local.rejects_by_reason
    want = {"dir": {"missing_transcript", "empty_transcript", "unreadable_audio"},
            "tsv": {"duplicate_id", "missing_file", "bad_row"},
            "librispeech": {"missing_audio", "missing_transcript"}}[fmt]
    assert want <= set(local.rejects_by_reason), local.rejects_by_reason


def test_worker_killed_mid_task_is_retried(cluster, tone_corpus, tmp_path):
    on_ray = _pack(tone_corpus, tmp_path / "ray", "ray", max_samples_per_shard=3)  # 10 shards: shard 9 is killed
    fired = _fault_marker(tmp_path / "ray")
    assert fired.exists(), "the armed fault did not kill a worker"
    fired.unlink()
    assert on_ray.shards == 10 and on_ray.shards_written == 10
    _pack(tone_corpus, tmp_path / "local", "local", max_samples_per_shard=3)
    assert dataset_sha256s(tmp_path / "ray") == dataset_sha256s(tmp_path / "local")


def test_driver_killed_mid_run_then_rerun_writes_only_missing(cluster, tmp_path):
    src = make_corpus(tmp_path / "in", [0.5 + 0.01 * i for i in range(40)], seed=13)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardtrain", "pack", str(src), str(out), "--engine", "ray", "--ray-address",
           cluster, "--max-samples-per-shard", "1", "--no-progress"]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list((out / "_work").glob("shard-*.json")) and time.monotonic() < deadline:
            assert driver.poll() is None, driver.stderr.read().decode() if driver.stderr else ""
            time.sleep(0.005)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.wait(30)
        if driver.stderr:
            driver.stderr.close()
    time.sleep(1.0)  # tasks of the dead driver's job are cancelled by Ray; let any in-flight rename land
    assert not (out / "manifest.json").exists(), "the driver finished before it was killed"
    done = sorted(p.name.replace(".json", ".tar") for p in (out / "_work").glob("shard-*.json"))
    assert 0 < len(done) < 40
    before = {n: (out / n).stat() for n in done}

    r = _pack(src, out, "ray", max_samples_per_shard=1)
    assert r.shards == 40 and r.shards_written <= 40 - len(done)
    for name, st in before.items():  # finished shards were not rewritten
        now = (out / name).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), name
    assert not (out / "_work").exists()
    _fault_marker(out).unlink(missing_ok=True)
    _pack(src, tmp_path / "clean", "local", max_samples_per_shard=1)
    assert dataset_sha256s(out) == dataset_sha256s(tmp_path / "clean")


@pytest.mark.s3
def test_ray_reads_and_writes_s3(cluster, s3, s3_bucket, tone_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fs, so = s3.fs(), s3.storage_options
    fs.put(str(tone_corpus) + "/", f"{s3_bucket}/corpus/", recursive=True)
    url = f"{s3_bucket}/ds"
    on_ray = _pack(f"{s3_bucket}/corpus", url, "ray", storage_options=so, max_samples_per_shard=8)
    local = _pack(f"{s3_bucket}/corpus", tmp_path / "local", "local", storage_options=so, max_samples_per_shard=8)
    assert (on_ray.samples, on_ray.shards) == (local.samples, local.shards) == (30, 4)
    for p in sorted((tmp_path / "local").iterdir()):
        remote = fs.cat_file(f"{url}/{p.name}")
        here = p.read_bytes()
        if p.name == "manifest.json":
            remote, here = (json.loads(x) for x in (remote, here))
            remote.pop("created_utc"), here.pop("created_utc")
        assert remote == here, p.name
    assert not [p for p in fs.find(f"{url}/_work") if p.endswith((".json", ".tar", ".tmp"))]
