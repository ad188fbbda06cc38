"""format: what the bytes of a packed dataset mean (shard format v1). Imports only `storage`.

    manifest.py  manifest.json + index.parquet: Dataset, ShardInfo, open_dataset, shard names, the index schema
    validate.py  manifest/index are untrusted input: bounded parse, contained names, row ranges; DatasetError
    tar.py       the byte-reproducible ustar writer and header reader (member offsets for the index)
    audio.py     the shard codecs and the decoders (bytes -> samples; the loader's GIL-free decode_into)
"""
