"""format: what the bytes of a packed dataset mean (shard format v1). Imports only `storage`.

    manifest.py  manifest.json + index.parquet: Dataset, ShardInfo, open_dataset, shard names, the index schema
    validate.py  manifest/index are untrusted input: bounded parse, whole-string names, row ranges, fields checked
                 against each other (num_samples = duration_s x rate); DatasetError
    indexread.py index.parquet's footer bounded (rows, types, chunk sizes) and its strings length-checked on the
                 dictionary, before anything is materialised
    locate.py    why a URL is not a dataset (wrong path, unpacked corpus, pack in progress) and the fixing command
    safe.py      printable(): data-derived text escaped for a terminal (control characters, bidi overrides)
    tar.py       the byte-reproducible ustar writer and header reader (member offsets for the index)
    limits.py    the format's limits (string bytes, member sizes, rates): one set, imported by pack and the readers
    codecs.py    the codecs a shard may store (flac, wav, opus, mp3): one definition for writer, reader and CLI
    audio.py     the decoders (bytes -> samples; the loader's GIL-free decode_into, float sources at true level)
    audioref.py  `<file>#bytes=START-END` audio references: one parser, one size bound, for pack and infer
    arrownp.py   Arrow columns as numpy arrays without pyarrow's lazy pandas import
"""
