"""pack: raw corpora -> shards + index.parquet + manifest.json. Imports `format` and `storage`, never `load`.

    item.py        Item | Reject, what every input reader yields, and the line/row helpers they share
    inputfs.py     where input files live: the filesystem of an input URL, Item.audio references, text opens
    sources.py     input formats (folder, TSV/CSV/JSONL, LibriSpeech, Lhotse cuts) -> Item | Reject
    corpora.py     Kaldi data dirs, Hugging Face datasets, Common Voice releases -> Item | Reject (via sources)
    metadata.py    folders described by one table: LJSpeech (metadata.csv + wavs/), Hugging Face audiofolder
    vtt.py         folders of recordings + WebVTT subtitles: one utterance per cue (start, end, text, voice)
    nothing.py     the one line a pack that accepted no utterance stops with (top reasons and the fix)
    probe.py       audio headers -> AudioInfo (duration, rate, channels, codec; exact MP3 lengths); reads
                   `file#bytes=START-END` references (audio inside an Arrow file or a Kaldi ark)
    transcode.py   keep original bytes or transcode to the target codec/rate/channels, with a decode check
    keys.py        sample keys that are safe in tar names and in webdataset (sanitised, de-duplicated)
    parts.py       the input cut into parts in input order (the unit of listing work for an engine)
    scan.py        one part of the input = one task: read items, probe headers, per-item filters -> PartScan
    itemcheck.py   per-item rejects for what a reader refuses (format/limits) and CTC-impossible transcripts
    layout.py        the global layout on the driver from PartScans: duplicates, keys, rejects, sort, shards, fingerprint
    shard_task.py  one shard = one task: the layout's samples -> tar bytes (run by a worker process or a Ray task)
    engine.py      where tasks run: LocalEngine (this process + a process pool) or RayEngine (`--engine ray`)
    config.py      PackConfig and the AudioTarget it holds: the options of a pack, validated once
    packer.py      pack(): parts -> engine.scan -> lay_out -> engine.write -> index -> manifest
    lifeline.py    pool workers die with the pack that started them (PDEATHSIG + a parent-watch thread)
    verify.py      `shardtrain inspect [--verify]`: summaries and integrity checks of a packed dataset
    safeio.py      bounded reads of untrusted input files (regular files only, at most a limit, never blocking)
    tailcheck.py   does an audio file's content reach the length its header claims (without a full decode)
"""
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as types; at run time each is imported on first use (__getattr__)
    from shardtrain.pack.config import AudioTarget, PackConfig
    from shardtrain.pack.packer import PackResult, pack
    from shardtrain.pack.shard_task import PackError

_LAZY = {"AudioTarget": "config", "PackConfig": "config", "PackResult": "packer", "pack": "packer",
         "PackError": "shard_task"}
"""The room's API, imported on first use: `shardtrain.pack.config` (what the CLI's --help reads its defaults from)
then costs no pyarrow, numpy or soundfile."""
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"shardtrain.pack.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardtrain.pack' has no attribute {name!r}")
