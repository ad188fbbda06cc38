"""testing: generated corpora and real servers for tests, benchmarks and the demo. Imports only `storage`.

    corpus.py    speech-like tone corpora in any codec, with manifests (no espeak needed)
    speech.py    real speech from espeak-ng + sox with fortune sentences
    s3server.py  LocalS3: SeaweedFS on loopback (and `python -m shardtrain.testing.s3server` for scripts)
    proxy.py     DropProxy: a TCP proxy that cuts connections, to inject network faults
    indexes.py   metadata-only datasets of any size (manifest + index, no shards) for planning tests
"""
