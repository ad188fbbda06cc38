"""Shared fixtures: a real SeaweedFS S3 server, a small espeak-ng speech corpus and a tone corpus.

All data is generated (shardtrain.testing), deterministic, and never committed. The S3 server is started once per
session (~1 s) and stopped at the end (~4 s after SIGTERM). A missing `weed` or espeak-ng fails the tests that
need them with the install command; nothing is skipped silently.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.testing.s3server import LocalS3
from shardtrain.testing.corpus import make_corpus
from shardtrain.testing.speech import synth_speech_corpus

# 30 varied durations (0.2-9.44 s, 139.98 s in all), fixed so tests can hand-check totals and sort orders;
# 0.2 s appears twice (utt-00000, utt-00029) to exercise the (duration_s, key) tie-break.
TONE_DURATIONS_S = [round(0.2 + (i * 37 % 29) * 0.33, 2) for i in range(30)]
SPEECH_UTTERANCES = 20


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A started LocalS3 (SeaweedFS on loopback) shared by the session; see shardtrain.testing.s3server."""
    try:
        server = LocalS3(tmp_path_factory.mktemp("s3") / "data").start()
    except FileNotFoundError as e:  # weed binary missing
        pytest.fail(f"{e} (run scripts/setup)", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3, request) -> str:
    """A fresh bucket per test, `s3://t-<test-name>-<sha1(nodeid)[:8]>` (unique across modules), on the session
    server. Returns the URL without a trailing slash."""
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:48].strip("-")
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    return s3.make_bucket(f"t-{name}-{digest}")


@pytest.fixture(scope="session")
def speech_corpus(tmp_path_factory):
    """20 espeak-ng utterances, LibriSpeech layout, built-in sentences (same text on every machine). Read-only."""
    try:
        return synth_speech_corpus(tmp_path_factory.mktemp("speech"), SPEECH_UTTERANCES, seed=0,
                                   progress=False, text_source="builtin")
    except RuntimeError as e:
        if "espeak-ng not found" in str(e):
            pytest.fail(f"{e} (run scripts/setup)", pytrace=False)
        raise


@pytest.fixture(scope="session")
def tone_corpus(tmp_path_factory):
    """make_corpus of TONE_DURATIONS_S as 16 kHz mono FLAC, seed 0. Read-only."""
    return make_corpus(tmp_path_factory.mktemp("tones"), TONE_DURATIONS_S, seed=0)


# ---- plain helpers shared by test modules (import them: `from conftest import pack_subset`) ------------------
def pack_subset(corpus: Path, out: Path, n: int) -> str:
    """Pack the first `n` utterances of a generated corpus's manifest.tsv into `out/shards` (2 per shard)."""
    from shardtrain.pack import PackConfig, pack

    rows = (corpus / "manifest.tsv").read_text().splitlines()
    out.mkdir(parents=True, exist_ok=True)
    tsv = out / "subset.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[1 : n + 1]]) + "\n")
    pack(PackConfig(input=str(tsv), output=str(out / "shards"), max_samples_per_shard=2, progress=False))
    return str(out / "shards")


ROOT = Path(__file__).resolve().parent.parent


def shardtrain_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None
                   ) -> subprocess.CompletedProcess:
    """`python -m shardtrain ARGS` in a fresh interpreter, as a user's shell runs it: this checkout on PYTHONPATH,
    one OpenMP thread, no AWS_* variables from the caller's environment (`env` adds or overrides)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd,
                          env={**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})


_MANY = """
import contextlib, io, json, sys, time
from shardtrain.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else 1
    results.append([code, out.getvalue(), err.getvalue(), time.monotonic() - t0])
print(json.dumps(results))
"""


def shardtrain_cli_many(*argvs: list[str], timeout: float = 300, cwd: Path | None = None, env: dict | None = None
                        ) -> list[subprocess.CompletedProcess]:
    """Several commands through `shardtrain.cli.main` in ONE fresh interpreter (torch imported once, not once per
    command: ~4 s each on 2 busy cores), each with its own stdout/stderr and exit status, as shardtrain_cli's
    (`env` adds or overrides variables, as there); each result's `wall_s` is its command's time, import aside."""
    import json

    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    p = subprocess.run([sys.executable, "-c", _MANY, json.dumps([list(a) for a in argvs])], capture_output=True,
                       text=True, timeout=timeout, cwd=cwd,
                       env={**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    done = []
    for a, (code, out, err, wall_s) in zip(argvs, json.loads(p.stdout.strip().splitlines()[-1])):
        done.append(subprocess.CompletedProcess(a, code, out, err))
        done[-1].wall_s = wall_s
    return done


def one_error_line(p: subprocess.CompletedProcess, command: str) -> str:
    """The one line a command prints for an error the user can act on (`COMMAND: error: ...`), no traceback;
    log lines (INFO/WARNING) aside."""
    lines = [x for x in p.stderr.splitlines() if x.strip() and " INFO " not in x and " WARNING " not in x]
    assert len(lines) == 1 and lines[0].startswith(f"{command}: error"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    return lines[0]


def cli_help(command: str) -> str:
    """`shardtrain COMMAND --help` from the real parser, in this process (argparse prints it and exits 0)."""
    import contextlib
    import io

    from shardtrain.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    text = out.getvalue()
    assert text.startswith(f"usage: shardtrain {command} "), text[:200]
    return text


def pack_tones(root: Path, durations: list[float], seed: int, *, input_name: str = "", sample_rate_hz: int = 16000,
               **pack_kw) -> str:
    """make_corpus(root/corpus, durations, seed, sample_rate_hz) packed into root/ds (8 samples a shard, one worker
    unless `pack_kw` says otherwise); `input_name` picks a file of the corpus (e.g. manifest.jsonl) as the input.
    Returns the dataset path."""
    from shardtrain.pack.packer import PackConfig, pack

    corpus = make_corpus(root / "corpus", durations, seed=seed, sample_rate_hz=sample_rate_hz)
    out = root / "ds"
    kw = {"max_samples_per_shard": 8, "workers": 1, "progress": False, **pack_kw}
    pack(PackConfig(input=str(corpus / input_name if input_name else corpus), output=str(out), **kw))
    return str(out)


def read_tsv(path: Path) -> list[dict]:
    """Rows of a generated manifest.tsv as dicts (header names as keys)."""
    import csv

    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def dataset_sha256s(out: Path) -> dict[str, str]:
    """sha256 of every file of a dataset; manifest.json without created_utc (the one wall-clock field)."""
    got = {}
    for p in sorted(out.iterdir()):
        data = p.read_bytes()
        if p.name == "manifest.json":
            m = json.loads(data)
            m.pop("created_utc")
            data = json.dumps(m, sort_keys=True).encode()
        got[p.name] = hashlib.sha256(data).hexdigest()
    return got


@pytest.fixture(scope="session")
def tones24(tmp_path_factory) -> Path:
    """24 tone utterances (0.3-1.9 s, 3 speakers) packed from manifest.tsv, 5 a shard (5 shards). Read-only."""
    from shardtrain.pack.packer import PackConfig, pack

    root = tmp_path_factory.mktemp("tones24")
    corpus = make_corpus(root / "corpus", [0.3 + 0.2 * (i % 9) for i in range(24)], seed=7)
    pack(PackConfig(input=str(corpus / "manifest.tsv"), output=str(root / "out"), max_samples_per_shard=5,
                    progress=False))
    return root / "out"


def copy_dataset(dataset: Path, tmp_path: Path) -> Path:
    """A writable copy of a read-only dataset fixture, at tmp_path/copy."""
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(dataset, dst)
    return dst

@pytest.fixture
def index_dataset(tmp_path) -> str:
    """A metadata-only dataset of 3000 rows, 500 a shard (testing/indexes.py), per test: tests edit it."""
    from shardtrain.testing.indexes import write_index_dataset

    return write_index_dataset(tmp_path / "ds", 3000, per_shard=500)

@pytest.fixture(scope="session")
def tagged_tones(tmp_path_factory) -> tuple[str, dict]:
    """24 tones packed from a TSV with speaker and language columns (5 a shard); (dataset url, {id: source row})
    with each row's path, text, speaker, language. Read-only (the interop adapters' tests)."""
    from shardtrain.pack.packer import PackConfig, pack

    root = tmp_path_factory.mktemp("tagged")
    corpus = make_corpus(root / "corpus", [0.3 + 0.2 * ((i * 7) % 13) for i in range(24)], seed=4)
    rows = {}
    lines = ["path\ttext\tspeaker\tlanguage"]
    for i, p in enumerate(sorted(corpus.glob("*.flac"))):
        text = (corpus / (p.stem + ".txt")).read_text().strip()
        rows[p.stem] = {"path": str(p), "text": text, "speaker": f"spk{i % 3}", "language": ["en", "de"][i % 2]}
        lines.append(f"{p.name}\t{text}\tspk{i % 3}\t{['en', 'de'][i % 2]}")
    (corpus / "extra.tsv").write_text("\n".join(lines) + "\n")
    out = root / "ds"
    pack(PackConfig(input=str(corpus / "extra.tsv"), output=str(out), max_samples_per_shard=5, workers=1,
                    progress=False))
    return str(out), rows

# ---- small real training runs (train/, infer/) ---------------------------------------------------------------
# A 0.6M-parameter model, no augmentation/dropout unless a test turns them on, every batch = all utterances.
TRAIN_SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
               "train.warmup_steps=20", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
               "train.tensorboard=false", "train.progress=false", "train.cpu_threads=1"]


def train_small(data: str, out: Path, steps: int, *overrides: str, resume: bool = False,
                pipeline: str = "tiny_cpu") -> dict:
    """The real trainer in this process: `pipeline` + TRAIN_SMALL + data, out, steps, then `overrides`."""
    from pipelines import load_pipeline
    from shardtrain.train.loop import train
    from shardtrain.train.overrides import apply_overrides
    from shardtrain.world import World

    cfg = apply_overrides(load_pipeline(pipeline), TRAIN_SMALL + [
        f"train.data_url={data}", f"train.out_dir={out}", f"train.max_steps={steps}", *overrides])
    return train(cfg, World(), resume=resume)


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl of a run: (training rows, validation rows)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@pytest.fixture(scope="session")
def six_utts(speech_corpus, tmp_path_factory) -> str:
    """The first 6 espeak-ng utterances packed (2 a shard). Read-only."""
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("six"), 6)


OVERFIT_STEPS = 100


@pytest.fixture(scope="session")
def overfit_run(six_utts, tmp_path_factory) -> tuple[Path, dict]:
    """TRAIN_SMALL trained OVERFIT_STEPS steps on six_utts, validated on them at the end (CER ~0 there), metrics
    every 5 steps, checkpoints at 50 and 100: (run folder, train's result). One run shared by the loop's overfit
    test and every inference test (transcribe, evaluate, export). Read-only."""
    out = tmp_path_factory.mktemp("overfit") / "run"
    res = train_small(six_utts, out, OVERFIT_STEPS, f"train.val_data_url={six_utts}", "train.log_every_steps=5",
                      "train.val_every_steps=0", "train.ckpt_every_steps=50")
    return out, res


@pytest.fixture(scope="session")
def overfit_dir(overfit_run) -> Path:
    """overfit_run's run folder."""
    return overfit_run[0]


@pytest.fixture(scope="session")
def speech_utterances(speech_corpus) -> list[tuple[str, "object", str]]:
    """(key, float32 wave, reference) of all 20 speech_corpus files, decoded from FLAC (the first 6 are six_utts)."""
    import soundfile as sf

    out = []
    for line in (speech_corpus / "manifest.tsv").read_text().splitlines()[1:]:
        path, text, _ = line.split("\t")
        wave, rate = sf.read(speech_corpus / path, dtype="float32")
        assert rate == 16000
        out.append((Path(path).stem, wave, text))
    return out


def pad_waves(waves: list) -> tuple:
    """Numpy waves as one zero-padded float tensor [B, T] and their lengths [B]."""
    import torch

    return (torch.nn.utils.rnn.pad_sequence([torch.from_numpy(w) for w in waves], batch_first=True),
            torch.tensor([len(w) for w in waves]))


# ---- a Lightning run and its ONNX export (infer/ on Lightning checkpoints, onnx_runtime) ----------------------
LIGHTNING_FIT = '''
import dataclasses, sys
import torch
from pipelines.tiny_cpu import config
from shardtrain.interop.lightning import CTCLightningModule, ShardDataModule, build_trainer
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.train.model import ModelConfig
from shardtrain.train.text import CharVocab

root = sys.argv[1]
pack(PackConfig(input=str(make_corpus(root + "/corpus", [0.5, 0.7, 0.9, 1.1], seed=5)), output=root + "/ds",
                workers=1, progress=False))
torch.set_num_threads(1)
base = config()
cfg = dataclasses.replace(
    base, stream=dataclasses.replace(base.stream, bucket=BucketConfig(max_batch_seconds=2.0, num_buckets=1,
                                                                      chunk_mb=0.05), decode_threads=1, epochs=None),
    model=ModelConfig(d_model=32, num_layers=1, num_heads=2, conv_kernel=3),
    train=dataclasses.replace(base.train, max_steps=2, val_every_steps=2, ckpt_every_steps=2, val_max_batches=1,
                              warmup_steps=1, progress=False))
dm = ShardDataModule(root + "/ds", root + "/ds", stream=cfg.stream, seed=0)
module = CTCLightningModule(cfg, CharVocab.from_index(root + "/ds").to_json())
build_trainer(cfg, root + "/run", accelerator="cpu", devices=1, enable_model_summary=False).fit(module, datamodule=dm)
'''


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory) -> Path:
    """LIGHTNING_FIT in a subprocess: 4 tones packed, the tiny Conformer trained 2 steps by a Lightning Trainer
    (interop/lightning.build_trainer); root/run holds its step=N.ckpt checkpoints, root/ds the data. Read-only."""
    root = tmp_path_factory.mktemp("pl_export")
    p = subprocess.run([sys.executable, "-c", LIGHTNING_FIT, str(root)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, cwd=root)
    assert p.returncode == 0, p.stderr[-4000:]
    return root


@pytest.fixture(scope="session")
def lightning_export(lightning_run) -> tuple[Path, subprocess.CompletedProcess]:
    """`shardtrain export` of lightning_run's run, as the CLI in a subprocess: (model.onnx, the process)."""
    out = lightning_run / "model.onnx"
    return out, shardtrain_cli("export", str(lightning_run / "run"), str(out), timeout=600)

# ---- zero-padded wave batches for the feature and augmentation tests (train/) ---------------------------------
WAVE_LENGTHS = [16000, 12345, 8001, 5000, 401]


def wave_batch(lengths: list[int], seed: int = 0, rate: int = 16000):
    """Zero-padded band-limited-ish random waves (a few tones plus noise) with the given true lengths:
    (waves [B, T], lengths [B])."""
    import math

    import torch

    from shardtrain.train.features import valid_mask

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = max(lengths) if lengths else 0
    t = torch.arange(width) / rate
    freqs = 100 + 3000 * torch.rand(len(lengths), 3, generator=g)
    waves = (torch.sin(2 * math.pi * freqs[:, :, None] * t).sum(1) * 0.1
             + 0.01 * torch.randn(len(lengths), width, generator=g))
    return waves * valid_mask(lens, width), lens


def assert_padding_zero(waves, lengths) -> None:
    """Nothing but zeros past each row's true length."""
    import torch

    from shardtrain.train.features import valid_mask

    pad = ~valid_mask(lengths.to(waves.device), waves.shape[1])
    assert torch.count_nonzero(waves[pad]) == 0


def seeded(seed: int):
    """A CPU torch.Generator seeded with `seed`."""
    import torch

    return torch.Generator().manual_seed(seed)

# ---- a packed dataset and its index rewritten, as someone who controls a bucket would (format/ trust tests) ----
TRUST_DURS = [0.5, 0.6, 0.7, 0.8, 0.9, 0.65, 0.75, 0.85]  # all under 1 s: the old "+1 s" bound let every one through


@pytest.fixture(scope="session")
def trust_dataset(tmp_path_factory) -> Path:
    """TRUST_DURS packed by the real packer from real FLAC (4 samples a shard). Read-only: copy, then rewrite."""
    from shardtrain.pack.packer import PackConfig, pack

    root = tmp_path_factory.mktemp("trust_format")
    out = root / "ds"
    pack(PackConfig(input=str(make_corpus(root / "corpus", TRUST_DURS, seed=3)), output=str(out), workers=1,
                    max_samples_per_shard=4, progress=False))
    return out


def rewrite_index(src: Path, dst: Path, edit) -> Path:
    """A copy of the dataset whose index.parquet is `edit(table)` (written as pack writes it, dictionary on)."""
    import shutil

    import pyarrow.parquet as pq

    shutil.copytree(src, dst)
    table = pq.read_table(dst / "index.parquet")
    pq.write_table(edit(table), dst / "index.parquet", compression="zstd", store_schema=False)
    return dst


def set_column(table, name: str, values):
    """`table` with column `name` replaced by `values`, its field (type, dictionary) kept."""
    import pyarrow as pa

    i = table.column_names.index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))

def pytest_collection_modifyitems(config, items):
    """A test that uses the loopback S3 server is an `s3` test whether or not its module says so, so the fast tier
    (`scripts/test fast` = `-m "not slow and not s3"`) really starts no SeaweedFS."""
    for item in items:
        if {"s3", "s3_bucket"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.s3)
