"""interop/lhotse.py: a packed dataset as a lazy lhotse CutSet (dynamic bucketing, a forked DataLoader worker) and
as a manifest lhotse writes and reads back with its own readers; the audio equals the source FLAC."""
from __future__ import annotations

import numpy as np
import soundfile as sf
import torch


def test_lhotse_dynamic_bucketing_over_a_lazy_cutset_reads_the_packed_audio(tagged_tones):
    from lhotse.dataset import DynamicBucketingSampler, K2SpeechRecognitionDataset
    from lhotse.dataset.input_strategies import AudioSamples

    from shardtrain.interop.lhotse import open_cutset
    url, rows = tagged_tones
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


def test_lhotse_manifest_written_by_lhotse_reads_back_without_shardtrain(tagged_tones, tmp_path):
    from lhotse import CutSet
    from lhotse.serialization import get_default_io_backend, io_backend

    from shardtrain.interop.lhotse import open_cutset
    url, rows = tagged_tones
    open_cutset(url, install_backend=False).to_file(tmp_path / "cuts.jsonl.gz")  # lhotse writes its manifest
    cuts = CutSet.from_jsonl_lazy(tmp_path / "cuts.jsonl.gz")
    with io_backend(get_default_io_backend()):  # lhotse's own readers only (TarAsDirBackend)
        for cut in cuts:
            want, _ = sf.read(rows[cut.id]["path"], dtype="float32")
            np.testing.assert_allclose(cut.load_audio()[0], want, atol=1e-6)
            assert cut.supervisions[0].text == rows[cut.id]["text"]
    assert sorted(c.id for c in cuts) == sorted(rows)


def test_lhotse_dataset_repacked_in_place_never_reads_other_samples_bytes(tmp_path):
    """A dataset re-packed at the same URL (one sample fewer, so every offset moves): a cut of the CutSet opened
    before is refused, and a CutSet opened again reads each cut's own audio (the member map cached by the first
    read pointed into the neighbouring sample: utt-00001's cut returned utt-00002's audio)."""
    import pytest

    from shardtrain.interop.lhotse import open_cutset
    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.testing.corpus import make_corpus

    corpus = make_corpus(tmp_path / "corpus", [0.5] * 4, seed=2, fmt="wav")
    rows = (corpus / "manifest.tsv").read_text().splitlines()
    out = str(tmp_path / "ds")

    def pack_rows(lines: list[str], name: str, **kw) -> None:
        tsv = tmp_path / name
        tsv.write_text("\n".join([rows[0]] + [f"{corpus / r.split(chr(9))[0]}\t{r.split(chr(9), 1)[1]}"
                                              for r in lines]) + "\n")
        pack(PackConfig(input=str(tsv), output=out, max_samples_per_shard=4, workers=1, progress=False, **kw))

    def source(cut_id: str) -> np.ndarray:
        return sf.read(str(next(p for p in corpus.glob("*.wav") if cut_id.endswith(p.stem))), dtype="float32")[0]

    pack_rows(rows[1:], "all.tsv")
    old = {c.id: c for c in open_cutset(out)}
    np.testing.assert_allclose(old[sorted(old)[1]].load_audio()[0], source(sorted(old)[1]), atol=1e-6)
    pack_rows(rows[2:], "rest.tsv", overwrite=True)  # without the first sample: every later offset moves
    with pytest.raises(RuntimeError, match="changed since open_cutset"):  # lhotse re-raises the type
        old[sorted(old)[2]].load_audio()
    fresh = list(open_cutset(out))
    assert len(fresh) == 3
    for cut in fresh:
        np.testing.assert_allclose(cut.load_audio()[0], source(cut.id), atol=1e-6)
