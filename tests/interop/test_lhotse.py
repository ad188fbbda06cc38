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
