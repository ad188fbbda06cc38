"""shardtrain.pack.vtt: a folder of long recordings + WebVTT subtitles, packed for real into one sample per cue,
each sample's audio exactly the cue's range of the recording."""
from __future__ import annotations

import io

import numpy as np
import soundfile as sf
from test_corpora import do_pack, noise, packed, rejects

from shardtrain.pack.sources import detect_format
from shardtrain.pack.vtt import parse_cues

TALK = """\ufeffWEBVTT - a talk

NOTE the first cue has an identifier, the second a voice tag, settings and two lines

intro
00:00.000 --> 00:01.250
Hello &amp; <i>welcome</i>

00:00:01.250 --> 00:00:03.000 align:start position:10%
<v Ada Lovelace>The analytical
engine</v>

STYLE
::cue { color: red }

00:03.500 --> 00:03.400
END BEFORE START

00:03.500 --> 00:04.000
<b></b>

00:04.000 --> 00:05.500
last words
"""


def test_parse_cues_times_text_voice_and_bad_cues():
    cues = parse_cues(TALK)
    assert [(s, e) for _, s, e, _, _ in cues] == [(0.0, 1.25), (1.25, 3.0), (3.5, 3.4), (3.5, 4.0), (4.0, 5.5)]
    assert [t for *_, t, _ in cues] == ["Hello & welcome", "The analytical engine", "END BEFORE START", "",
                                       "last words"]
    assert cues[1][4] == "Ada Lovelace" and cues[0][4] is None


def test_vtt_folder_packs_one_sample_per_cue(tmp_path):
    src = tmp_path / "talks"
    rec = noise(src / "talk.flac", 6.0, seed=7)
    (src / "talk.vtt").write_text(TALK, encoding="utf-8")
    (src / "orphan.vtt").write_text("WEBVTT\n\n00:00.000 --> 00:01.000\nno audio\n", encoding="utf-8")
    assert detect_format(str(src)) == "vtt"
    out = tmp_path / "ds"
    res = do_pack(src, out)
    got = packed(str(out))
    want = {"talk-00000": rec[:20000], "talk-00001": rec[20000:48000], "talk-00004": rec[64000:88000]}
    assert sorted(got) == sorted(want) and res.samples == 3
    for key, x in want.items():
        row, data = got[key]
        y, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == 16000 and np.array_equal(y, x), key
        assert abs(row["duration_s"] - len(x) / 16000) < 1e-6
    assert got["talk-00001"][0]["text"] == "The analytical engine"
    assert got["talk-00001"][0]["speaker"] == "Ada Lovelace"
    rej = rejects(str(out))
    assert rej["talk-00002"] == "bad_segment" and rej["talk-00003"] == "empty_transcript"
    assert rej["orphan"] == "missing_audio"
