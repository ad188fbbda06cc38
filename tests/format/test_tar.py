"""format.tar: parse_header's fast path for the writer's own headers agrees with tarfile on damaged headers; a
shard assembled from parts is the shard written whole."""
import random
import tarfile

import pytest

from shardtrain.format import tar


def _tarfile_verdict(block: bytes):
    try:
        ti = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
    except (tarfile.HeaderError, UnicodeDecodeError):
        return "refused"
    return (ti.name, ti.size) if ti.isreg() else "refused"


def _ours(block: bytes):
    try:
        return tar.parse_header(block)
    except ValueError:
        return "refused"


def test_fast_header_path_matches_tarfile_on_mutated_headers():
    ti = tarfile.TarInfo("spk-1_utt-000123.flac")
    ti.size, ti.mtime, ti.mode = 123456, 0, 0o644
    good = ti.tobuf(format=tarfile.USTAR_FORMAT)
    assert tar._fast_header(good) == ("spk-1_utt-000123.flac", 123456)
    rnd, fast_taken = random.Random(0), 0
    for _ in range(20_000):
        b = bytearray(good)
        for _ in range(rnd.choice([1, 1, 2, 3])):
            pos = rnd.choice([rnd.randrange(512), rnd.randrange(100, 160), rnd.randrange(157, 345),
                              rnd.randrange(257, 265), rnd.randrange(345, 360)])
            b[pos] = rnd.choice([0, 32, 48, 49, 55, 56, 0x80, 0xFF, rnd.randrange(256)])
        if rnd.random() < 0.5:  # a consistent checksum, so the fast path sees the damage itself
            b[148:156] = b"        "
            b[148:156] = ("%06o\0 " % sum(b)).encode()
        block = bytes(b)
        fast_taken += tar._fast_header(block) is not None
        assert _ours(block) == _tarfile_verdict(block), block
    assert fast_taken > 1000  # the fast path was exercised, not only the fallback


def test_a_shard_assembled_from_parts_is_the_shard_written_whole():
    """Parts written by unhashed, never-closed writers and appended in order give the same bytes, sha256 and
    (shifted) member offsets as one writer; a part that is not whole blocks, or an append after close, is refused."""
    import hashlib
    import io

    from shardtrain.format.tar import BLOCK, ShardWriter

    samples = [(f"k{i}", "flac", bytes([i]) * (100 + 700 * i), b'{"i":%d}' % i) for i in range(5)]
    whole = io.BytesIO()
    with ShardWriter(whole) as w:
        ref = [w.add(*s) for s in samples]
    parts, offsets = [], []
    for chunk in (samples[:2], samples[2:3], samples[3:]):
        buf = io.BytesIO()
        pw = ShardWriter(buf, hashed=False)
        offsets.append([pw.add(*s) for s in chunk])
        parts.append(buf.getvalue())
        with pytest.raises(ValueError, match="hashed=False"):
            pw.sha256
    out = io.BytesIO()
    joined = ShardWriter(out)
    got = []
    for part, offs in zip(parts, offsets):
        base = joined.append(part)
        got += [(o.offset + base, o.audio_offset + base, o.json_offset + base, o.size) for o in offs]
    joined.close()
    assert out.getvalue() == whole.getvalue()
    assert joined.sha256 == w.sha256 == hashlib.sha256(whole.getvalue()).hexdigest()
    assert got == [(o.offset, o.audio_offset, o.json_offset, o.size) for o in ref]
    with pytest.raises(ValueError, match="whole"):
        ShardWriter(io.BytesIO()).append(b"x" * (BLOCK + 1))
    with pytest.raises(ValueError, match="closed"):
        joined.append(bytes(BLOCK))
