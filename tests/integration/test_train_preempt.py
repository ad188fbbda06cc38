"""Preemption and the run lease under real torchrun (gloo, CPU) and on SeaweedFS: real signals to the launcher, to
one rank, to one of two agents (`--nnodes 2`, c10d rendezvous on 127.0.0.1, node-local caches); two real trainers
racing for one --out. Every stop is at the same step on every rank, with a committed checkpoint and exit 75; the
resume trains every utterance of the epoch exactly once (`shardtrain ledger`)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtrain.train.checkpoint import list_checkpoints
from shardtrain.train.preempt import EXIT_PREEMPTED
from conftest import pack_subset

pytestmark = pytest.mark.slow

SMALL = ["model.d_model=32", "model.num_layers=1", "model.dropout=0", "train.augment=false", "train.warmup_steps=0",
         "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1", "stream.bucket.max_batch_size=1",
         "train.tensorboard=false", "train.log_every_steps=1", "train.ckpt_every_steps=1000", "train.cpu_threads=1"]
STEPS = 400  # never reached: every run here is stopped by a signal
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_args(data: str, out: str, *extra: str, steps: int = STEPS, resume: bool = False) -> list[str]:
    args = ["-m", "shardtrain", "train", "--data", data, "--pipeline", "tiny_cpu", "--max-steps", str(steps),
            "--out", out] + (["--resume"] if resume else [])
    for s in SMALL + list(extra):
        args += ["--set", s]
    return args


def torchrun(nproc: int, *rdzv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *(rdzv or ("--standalone",)), f"--nproc_per_node={nproc}"]


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode} early: {proc.stderr.read()[-3000:]}")
        if metrics.is_file() and any(json.loads(x).get("step", 0) >= step for x in metrics.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {metrics} after {timeout_s} s")


def rank_pid(agent: int, rank: int) -> int:
    """The pid of the worker of torchrun agent `agent` whose RANK is `rank` (from /proc: a real process)."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank} under {agent}")


def step_processes(shell: int) -> list[int]:
    """Every process of the session `shell` leads, except the shell itself."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int(p.name) != shell and os.getsid(int(p.name)) == shell:
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


def preempted_row(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("event") == "preempted"]
    return row


def ledger(out: Path) -> dict:
    res = subprocess.run([sys.executable, "-m", "shardtrain", "ledger", str(out), "--json"], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def data(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("twelve"), 12)


def _stop_and_check(proc: subprocess.Popen, out: Path, nranks: int) -> dict:
    _, err = proc.communicate(timeout=120)
    row = preempted_row(out)
    stopped = row["step"]
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [stopped]
    meta = json.loads((out / "checkpoints" / f"step_{stopped:06d}" / "meta.json").read_text())
    assert meta["world_size"] == nranks  # every rank wrote its state for the same step
    assert row["preempt_s"] < 30 and row["checkpoint_s"] <= row["preempt_s"], row
    assert not (out / "_train.lease").exists(), err[-2000:]  # released at exit
    return row


def test_sigterm_to_one_rank_stops_every_rank_at_one_step_then_resume_is_exactly_once(data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(torchrun(2) + ["-m", "shardtrain"] + train_args(data, str(out))[2:], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out / "metrics.jsonl", 3, proc)
    os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)  # rank 1 only: rank 0 learns it from the all-reduce
    row = _stop_and_check(proc, out, 2)
    assert proc.returncode != 0 and row["signal"] == "a signal on another rank"  # rank 0's row: it saw none
    stopped = row["step"]
    steps = stopped + 8  # past the 6-step epoch of 12 utterances over 2 ranks
    res = subprocess.run([sys.executable] + train_args(data, str(out), steps=steps, resume=True), env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = ledger(out)
    assert [(a["start_step"], a["world_size"]) for a in rep["attempts"]] == [(0, 2), (stopped, 1)]
    assert rep["replaced"] == [] and rep["redone"] == {"steps": 0, "audio_s": 0}  # none wasted
    e0 = rep["epochs"][0]
    assert e0["complete"] and e0["exactly_once"] and e0["datasets"][0]["once"] == 12


def test_sigterm_to_the_launcher_checkpoints_and_exits_75(data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(torchrun(2) + ["-m", "shardtrain"] + train_args(data, str(out))[2:], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    row = _stop_and_check(proc, out, 2)
    assert row["signal"] == "SIGTERM"


def test_one_process_exits_75_on_sigusr1_and_on_ctrl_c(data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable] + train_args(data, str(out)), env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(out / "metrics.jsonl", 2, proc)
    for pid in [proc.pid, *step_processes(proc.pid)]:  # a scheduler signals every process of the job
        os.kill(pid, signal.SIGUSR1)
    row = _stop_and_check(proc, out, 1)
    assert proc.returncode == EXIT_PREEMPTED and row["signal"] == "SIGUSR1"
    proc = subprocess.Popen([sys.executable] + train_args(data, str(out), resume=True), env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out / "metrics.jsonl", row["step"] + 2, proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C (the second one: tests/train/test_preempt.py)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    again = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                                               if '"preempted"' in x][-1]
    assert again["signal"] == "SIGINT" and again["step"] > row["step"]
    assert [s for s, _ in list_checkpoints(out / "checkpoints")][-1] == again["step"]


def test_two_nodes_sigterm_one_node_then_resume_on_one_node(data, tmp_path):
    """Two torchrun agents (--nnodes 2, one process each), c10d rendezvous on 127.0.0.1, node-local caches."""
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = ("--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes")
    agents = []
    for node in range(2):
        local = tmp_path / f"node{node}"
        (local / "tmp").mkdir(parents=True)
        cmd = torchrun(1, *rdzv, f"--node-rank={node}") + ["-m", "shardtrain"] + train_args(
            data, str(out), f"stream.cache_dir={local / 'cache'}")[2:]
        agents.append(subprocess.Popen(cmd, env={**ENV, "TMPDIR": str(local / "tmp")}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
    wait_for_step(out / "metrics.jsonl", 2, agents[0])
    agents[1].send_signal(signal.SIGTERM)  # node 1's agent, as SLURM/Kubernetes would
    row = _stop_and_check(agents[0], out, 2)
    agents[1].communicate(timeout=60)
    stopped = row["step"]
    res = subprocess.run(torchrun(1) + ["-m", "shardtrain"] + train_args(data, str(out), steps=stopped + 8,
                                                                         resume=True)[2:],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = ledger(out)
    assert [(a["start_step"], a["world_size"]) for a in rep["attempts"]] == [(0, 2), (stopped, 1)]
    e0 = rep["epochs"][0]
    assert e0["complete"] and e0["exactly_once"] and e0["datasets"][0]["once"] == 12


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_two_trainers_racing_for_one_out_one_is_refused_naming_the_holder(data, tmp_path, where, request):
    if where == "s3":
        s3, bucket = request.getfixturevalue("s3"), request.getfixturevalue("s3_bucket")
        out = f"{bucket}/race"
        so = [x for k, v in s3.storage_options.items() for x in ("--storage-option", f"{k}={json.dumps(v)}")]
    else:
        out, so = str(tmp_path / "run"), []
    env = {**ENV, "AWS_DEFAULT_REGION": "us-east-1"}
    procs = [subprocess.Popen([sys.executable] + train_args(data, out, steps=3) + so, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(c for c, _ in results)
    assert codes == [0, 1], [e[-1500:] for _, e in results]
    err = [e for c, e in results if c == 1][0].strip().splitlines()[-1]
    assert err.startswith("train: error: ") and "is locked by another trainer: pid " in err and "on host" in err


def _slurm_stand_ins(tmp_path: Path) -> tuple[Path, dict]:
    """(repository, environment) for scripts/slurm_train.sbatch on one "node": srun and scontrol are the only
    stand-ins (no SLURM here); srun runs its command, scontrol names this host and records the requeue."""
    repo = Path(__file__).resolve().parents[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\nshift\nexec \"$@\"\n")
    (bin_dir / "scontrol").write_text(f"#!/usr/bin/env bash\nif [ \"$1\" = show ]; then echo 127.0.0.1; "
                                      f"else echo \"$@\" >> {tmp_path / 'requeued'}; fi\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(repo), "NPROC": "2", "PIPELINE": "tiny_cpu",
           "RDZV_PORT": str(port), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    return repo, env


def test_slurm_recipe_saves_on_sigterm_requeues_and_the_requeued_job_finishes(data, tmp_path):
    """scripts/slurm_train.sbatch as it is, with stand-ins for srun and scontrol (_slurm_stand_ins)."""
    repo, env = _slurm_stand_ins(tmp_path)
    out = tmp_path / "run"
    args = [a for a in train_args(data, str(out))[3:] if a not in ("--pipeline", "tiny_cpu")]  # PIPELINE names it
    proc = subprocess.Popen(["bash", str(repo / "scripts/slurm_train.sbatch"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(out / "metrics.jsonl", 2, proc)
    for pid in step_processes(proc.pid):  # SLURM signals every process of the step, not the batch shell
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    stopped = preempted_row(out)["step"]
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [stopped]
    args[args.index("--max-steps") + 1] = str(stopped + 2)
    res = subprocess.run(["bash", str(repo / "scripts/slurm_train.sbatch"), *args],
                         env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped:06d}'}" in res.stderr
    assert (tmp_path / "requeued").read_text().count("requeue") == 1


def test_slurm_recipe_does_not_requeue_a_usage_error(data, tmp_path):
    """A typo in a --set key: every worker exits 2, torchrun reports 1; the script learns it was a usage error from
    SHARDTRAIN_EXIT_FILE and exits 2 without a requeue (it used to requeue it MAX_REQUEUES times)."""
    repo, env = _slurm_stand_ins(tmp_path)
    args = [a for a in train_args(data, str(tmp_path / "run"))[3:] if a not in ("--pipeline", "tiny_cpu")]
    res = subprocess.run(["bash", str(repo / "scripts/slurm_train.sbatch"), *args, "--set", "train.no_such_key=1"],
                         env={**env, "MAX_RESTARTS": "0"}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "no_such_key" in res.stderr and "not requeued" in res.stderr
    assert not (tmp_path / "requeued").exists()
    assert not list(tmp_path.glob("shardtrain-exit-*"))  # the script removes its file
