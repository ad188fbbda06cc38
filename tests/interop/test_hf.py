"""interop/hf.py: Hugging Face `datasets` reads a packed dataset through its webdataset builder, map-style and
streaming, offline; the audio equals the source FLAC and the JSON carries the transcript and tags."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_load_dataset_webdataset_yields_audio_and_text(tagged_tones, tmp_path, monkeypatch, streaming):
    import datasets

    from shardtrain.interop import hf
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    url, rows = tagged_tones
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
