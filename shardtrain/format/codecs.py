"""The audio codecs a shard may store: one definition for the writer, the packer, the CLI and the reader.

Each is what soundfile (libsndfile 1.2) reads and writes without a system library: 16-bit FLAC and WAV, Ogg/Opus,
MP3. The extension is the tar member's suffix (`<key>.<codec>`), so webdataset tools see the usual names.
"""
CODECS = ("flac", "wav", "opus", "mp3")
"""Member extensions of the audio in a shard, and the values of `--codec`."""
SF_FORMAT = {"flac": ("FLAC", "PCM_16"), "wav": ("WAV", "PCM_16"), "opus": ("OGG", "OPUS"),
             "mp3": ("MP3", "MPEG_LAYER_III")}
"""codec -> (soundfile format, subtype) used when transcoding."""
ENCODE_RATIO = {"wav": 1.0, "flac": 0.6, "opus": 0.08, "mp3": 0.1}
"""Stored bytes / 16-bit PCM bytes, for planning shard sizes only (real FLAC speech is ~0.5-0.65)."""
