"""Adapters to other tools (shardtrain.interop) on a real packed dataset: torch/torchdata DataLoaders and Batch moves."""
from __future__ import annotations

import numpy as np
import soundfile as sf
import pytest
import torch

from shardtrain.interop.torchdata import BatchStream
from shardtrain.load.batch import Batch
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

from conftest import pack_tones

DURS = [0.3 + 0.2 * ((i * 7) % 13) for i in range(40)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_tones(tmp_path_factory.mktemp("interop"), DURS, seed=3)


def loader(url, world=World(), state=None):
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=5.0, chunk_mb=0.05, num_buckets=3), epochs=2)
    return build_loader(url, world=world, seed=7, cfg=cfg, state=state)


def sig(b: Batch) -> tuple:
    return (b.epoch, b.step, tuple(b.keys), tuple(b.texts), b.waves.sum().item())


def test_dataloader_batch_size_none_yields_the_loaders_batches(dataset):
    want = [sig(b) for b, _ in loader(dataset)]
    dl = torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None)
    got = [sig(b) for b in dl]
    assert got == want and len(want) > 6 and {w[0] for w in want} == {0, 1}
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None, num_workers=1)))


def test_loader_load_state_dict_resumes_at_the_next_batch(dataset):
    full = [sig(b) for b in loader(dataset).batches()]
    first = loader(dataset)
    it = first.batches()
    head = [sig(next(it)) for _ in range(5)]
    state = first.state_dict()
    it.close()  # stops the first loader's read-ahead
    again = loader(dataset)
    again.load_state_dict(state)
    assert head + [sig(b) for b in again.batches()] == full
    assert again.state_dict()["counters"]["batches"] == len(full)


def test_stateful_dataloader_checkpoint_carries_the_cursor(dataset):
    from torchdata import stateful_dataloader as sdl
    full = [sig(b) for b in loader(dataset).batches()]
    dl = sdl.StatefulDataLoader(BatchStream(loader(dataset)), batch_size=None)
    it = iter(dl)
    head = [sig(next(it)) for _ in range(4)]
    sd = dl.state_dict()
    assert sd["dataset_state"]["step"] == 4  # the loader's own cursor, not a count of items to replay
    dl2 = sdl.StatefulDataLoader(BatchStream(loader(dataset)), batch_size=None)
    dl2.load_state_dict(sd)
    assert head + [sig(b) for b in dl2] == full


def test_batch_moves_like_a_tensor_container(dataset):
    b = next(loader(dataset).batches())
    m = b.to("meta")
    assert isinstance(m, Batch) and m.keys == b.keys and m.texts == b.texts
    assert {t.device.type for t in (m.waves, m.lengths, m.durations_s)} == {"meta"} and b.waves.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning and CUDA copies need a GPU")
def test_batch_pins_and_copies_to_cuda(dataset):
    b = next(loader(dataset).batches())
    p = b.pin_memory()
    assert p.waves.is_pinned() and p.lengths.is_pinned() and not b.waves.is_pinned()
    c = p.to("cuda", non_blocking=True)
    assert c.waves.is_cuda and torch.equal(c.waves.cpu(), b.waves) and c.keys == b.keys
    dl = torch.utils.data.DataLoader(BatchStream(loader(dataset)), batch_size=None, pin_memory=True)
    assert next(iter(dl)).waves.is_pinned()


# ---- lhotse ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lhotse_dataset(tmp_path_factory):
    """A corpus packed from a TSV with speaker and language columns; returns (dataset url, {id: source row})."""
    root = tmp_path_factory.mktemp("lhotse")
    corpus = make_corpus(root / "corpus", DURS[:24], seed=4)
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


def test_lhotse_dynamic_bucketing_over_a_lazy_cutset_reads_the_packed_audio(lhotse_dataset):
    from lhotse.dataset import DynamicBucketingSampler, K2SpeechRecognitionDataset
    from lhotse.dataset.input_strategies import AudioSamples

    from shardtrain.interop.lhotse import open_cutset
    url, rows = lhotse_dataset
    cuts = open_cutset(url)
    assert cuts.is_lazy
    sampler = DynamicBucketingSampler(cuts, max_duration=6.0, num_buckets=2, shuffle=True, seed=0)
    seen = []
    for batch in sampler:
        assert sum(c.duration for c in batch) <= 6.0 + 1e-6
        for cut in batch:
            src = rows[cut.id]
            want, rate = sf.read(src["path"], dtype="float32")
            got = cut.load_audio()
            assert rate == cut.sampling_rate == 16000 and got.shape == (1, len(want))
            np.testing.assert_allclose(got[0], want, atol=1e-6)
            sup = cut.supervisions[0]
            assert (sup.text, sup.speaker, sup.language) == (src["text"], src["speaker"], src["language"])
            assert abs(cut.duration - len(want) / rate) < 1e-9
            seen.append(cut.id)
    assert sorted(seen) == sorted(rows)
    dataset = K2SpeechRecognitionDataset(input_strategy=AudioSamples(), return_cuts=True)
    dl = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=1)  # a forked worker
    texts = []
    for b in dl:
        assert b["inputs"].ndim == 2 and b["inputs"].shape[0] == len(b["supervisions"]["text"])
        for cut, wave in zip(b["supervisions"]["cut"], b["inputs"]):
            want, _ = sf.read(rows[cut.id]["path"], dtype="float32")
            np.testing.assert_allclose(wave[:len(want)].numpy(), want, atol=1e-6)
        texts += b["supervisions"]["text"]
    assert sorted(texts) == sorted(r["text"] for r in rows.values())


def test_lhotse_manifest_written_by_lhotse_reads_back_without_shardtrain(lhotse_dataset, tmp_path):
    from lhotse import CutSet
    from lhotse.serialization import get_default_io_backend, io_backend

    from shardtrain.interop.lhotse import open_cutset
    url, rows = lhotse_dataset
    open_cutset(url, install_backend=False).to_file(tmp_path / "cuts.jsonl.gz")  # lhotse writes its manifest
    cuts = CutSet.from_jsonl_lazy(tmp_path / "cuts.jsonl.gz")
    with io_backend(get_default_io_backend()):  # lhotse's own readers only (TarAsDirBackend)
        for cut in cuts:
            want, _ = sf.read(rows[cut.id]["path"], dtype="float32")
            np.testing.assert_allclose(cut.load_audio()[0], want, atol=1e-6)
            assert cut.supervisions[0].text == rows[cut.id]["text"]
    assert sorted(c.id for c in cuts) == sorted(rows)


# ---- Hugging Face datasets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True])
def test_hf_load_dataset_webdataset_yields_audio_and_text(lhotse_dataset, tmp_path, monkeypatch, streaming):
    import datasets

    from shardtrain.interop import hf
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    url, rows = lhotse_dataset
    ds = datasets.load_dataset("webdataset", data_files={"train": hf.data_files(url)}, features=hf.features(url),
                               split="train", cache_dir=str(tmp_path / "hf"), streaming=streaming)
    got = list(ds)
    assert sorted(r["__key__"] for r in got) == sorted(rows)
    for r in got:
        src = rows[r["__key__"]]
        samples, rate = hf.decode_audio(r)
        want, want_rate = sf.read(src["path"], dtype="float32")
        assert rate == want_rate and np.array_equal(samples, want)
        j = r["json"]
        assert (j["text"], j["speaker"], j["language"]) == (src["text"], src["speaker"], src["language"])
        assert j["num_samples"] == len(want)
