"""Where input files live, for every input reader (sources, corpora, metadata): the filesystem of an input URL,
the reference an `Item` carries, and text opens of manifests (`.gz` included).

Storage access goes through `shardtrain.storage` (one way to open a URL, with its S3 tuning); this module only
adds what the readers agree on. Cheap: no I/O beyond the open a caller asks for.
"""
from __future__ import annotations

import gzip
import io
import posixpath

from shardtrain import storage


def input_fs(url: str, storage_options: dict | None) -> tuple[storage.FileSystem, str]:
    """Filesystem and path of an input URL, without a trailing "/"."""
    fs, path = storage.fs_and_path(url, storage_options)  # one way to open a URL, with the S3 tuning
    return fs, path.rstrip("/") or path


def audio_ref(fs: storage.FileSystem, path: str) -> str:
    """What goes into Item.audio: a plain path for local files (fast opens), the full URL otherwise."""
    return path if storage.fs_is_local(fs) else fs.unstrip_protocol(path)


def resolve_audio(base_dir: str, audio: str, fs: storage.FileSystem) -> str:
    """Resolve a manifest's audio path: URLs and absolute paths as given, relative ones against the manifest folder."""
    if "://" in audio or audio.startswith("/"):
        return audio
    return audio_ref(fs, posixpath.normpath(posixpath.join(base_dir, audio)))


def open_text(fs: storage.FileSystem, path: str) -> io.TextIOBase:
    """A manifest as UTF-8 text (gunzipped when it ends in .gz), newlines untranslated, a leading UTF-8 BOM dropped
    (Windows editors write one; read as text it cost a JSONL manifest its first row and hid a header's first
    column), so no reader strips it on its own."""
    raw = fs.open(path, "rb")
    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    return io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
