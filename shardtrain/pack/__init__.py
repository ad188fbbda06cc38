"""pack: raw corpora -> shards + index.parquet + manifest.json. Imports `format` and `storage`, never `load`.

    sources.py     input formats (folder, TSV/CSV/JSONL, LibriSpeech, Lhotse cuts) -> Item | Reject
    corpora.py     Kaldi data dirs, Hugging Face datasets, Common Voice releases -> Item | Reject (via sources)
    probe.py       audio headers -> AudioInfo (duration, rate, channels, codec; exact MP3 lengths); reads
                   `file#bytes=START-END` references (audio inside an Arrow file or a Kaldi ark)
    transcode.py   keep original bytes or transcode to the target codec/rate/channels, with a decode check
    keys.py        sample keys that are safe in tar names and in webdataset (sanitised, de-duplicated)
    shard_task.py  one shard = one task: planned samples -> tar bytes (run by a worker process)
    packer.py      PackConfig and pack(): probe in threads -> global sort -> plan shards -> write in a pool -> commit
    lifeline.py    pool workers die with the pack that started them (PDEATHSIG + a parent-watch thread)
    verify.py      `shardtrain inspect [--verify]`: summaries and integrity checks of a packed dataset
"""
from shardtrain.pack.packer import PackConfig, PackResult, pack
from shardtrain.pack.shard_task import PackError

__all__ = ["PackConfig", "PackError", "PackResult", "pack"]
