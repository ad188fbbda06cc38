"""`shardtrain bench` / bench_loader report only what they measured (issue 22) and the epoch-start data wait
(issue 20): no steady rate from too few batches (one line says how many it needs), no augment or h2d stage that
did not run, the first steps of every epoch against the median; and the torchdata snippet reaches state_dict()."""
import json
import subprocess
import sys

import pytest

from shardtrain.load.bench import BenchConfig, bench_loader, steady_batches_needed
from shardtrain.load.config import StreamConfig
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

DURS = [0.3 + 0.2 * ((i * 7) % 13) for i in range(40)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchout")
    corpus = make_corpus(root / "corpus", DURS, seed=3)
    pack(PackConfig(input=str(corpus), output=str(root / "ds"), max_samples_per_shard=8, workers=1, progress=False))
    return str(root / "ds")


def run(dataset, epochs, budget=5.0):
    stream = StreamConfig(bucket=BucketConfig(max_batch_seconds=budget))
    return bench_loader(dataset, world=World(), seed=0, stream=stream, bench=BenchConfig(epochs=epochs))


def test_no_steady_rate_from_too_few_batches_and_only_stages_that_ran(dataset):
    out = run(dataset, 1, budget=12.0)
    need = steady_batches_needed(StreamConfig())
    assert out["batches"] - 1 < need
    assert out["steady_audio_s_per_s"] is None and f">= {need} batches" in out["steady_refused"]
    assert "stage_augment_s" not in out and "stage_h2d_s" not in out and "stage_decode_s" in out


def test_steady_rate_and_epoch_start_waits_with_enough_batches(dataset):
    out = run(dataset, 4, budget=2.0)
    assert out["batches"] - 1 >= steady_batches_needed(StreamConfig())
    assert out["steady_audio_s_per_s"] > 0 and "steady_refused" not in out
    assert set(out["epoch_start_wait_ms"]) == {"0", "1", "2", "3"} and out["median_wait_ms"] >= 0


def test_cli_says_why_in_one_line(dataset):
    p = subprocess.run([sys.executable, "-m", "shardtrain", "bench", dataset, "--no-progress",
                        "--max-batch-seconds", "12"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "steady" in ln]
    assert len(lines) == 1 and "needs >=" in lines[0]
    assert "augment" not in p.stdout
    js = subprocess.run([sys.executable, "-m", "shardtrain", "bench", dataset, "--no-progress", "--json"],
                        capture_output=True, text=True, timeout=300)
    assert "epoch_start_wait_ms" in json.loads(js.stdout)


def test_torchdata_snippet_reaches_state_dict_and_resumes(dataset):
    """README's snippet with a loader built from defaults: the loop ends after one epoch and the state resumes."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from shardtrain.interop.torchdata import BatchStream
    from shardtrain.load.loader import build_loader

    loader = build_loader(dataset, world=World(), seed=0, cfg=StreamConfig())
    dl = StatefulDataLoader(BatchStream(loader), batch_size=None)
    n = sum(1 for _ in dl)
    state = dl.state_dict()
    assert n > 0 and (state["dataset_state"]["epoch"], state["dataset_state"]["step"]) == (1, 0)
    again = StatefulDataLoader(BatchStream(build_loader(dataset, world=World(), seed=0, cfg=StreamConfig())),
                               batch_size=None)
    again.load_state_dict(state)
    assert sum(1 for _ in again) == 0
