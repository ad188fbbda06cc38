"""Commands that do not train import no torch (~1.5 s and ~700 MB), and a mistyped local path is refused before
pyarrow, numpy or fsspec load (~0.3 s of CPU together), so it answers at once and leaves nothing behind. Each command
runs in a fresh interpreter, as a user's shell would start it; what it imported is read from sys.modules."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from shardtrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code,
      ",".join(m for m in ("pyarrow", "numpy", "fsspec", "s3fs") if m in sys.modules) or "-")
"""


@pytest.mark.parametrize("argv", [
    ["pack", "{missing}", "{out}"],
    ["inspect", "{missing}"],
    ["plan", "{missing}", "--world-size", "2"],
    ["ledger", "{missing}"],
])
def test_commands_that_do_not_train_import_no_torch_on_a_bad_path(tmp_path, argv):
    missing, out = tmp_path / "no-such-corpus", tmp_path / "out"
    args = [a.format(missing=missing, out=out) for a in argv]
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("NO-TORCH"), (argv[0], r.stdout, r.stderr[-1500:])
    assert last.split()[1] in ("1", "2"), r.stdout  # refused, not a success
    assert last.split()[2] == "-", f"{argv[0]} imported {last.split()[2]} before refusing a missing local path"
    assert "no-such-corpus" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists(), "a refused pack created its OUTPUT"


def test_parser_has_every_command_and_version(capsys):
    """build_parser registers one subparser per verb module; --version prints the package's version."""
    from shardtrain._version import __version__
    from shardtrain.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"synth", "pack", "inspect", "bench", "train", "augment-demo", "transcribe",
                                "evaluate", "export", "tune", "plan", "ledger"}
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"shardtrain {__version__}"



def test_a_real_pack_imports_neither_torch_nor_pandas(tmp_path):
    """A pack that meets every layout path (a sanitised-key clash, a duplicate id, a corrupt file, a missing
    transcript, several shards, two workers) runs without torch (~1.5 s) and without pandas, which pyarrow imports
    on its first `pa.array` or `to_numpy` (~0.3 s wall, ~0.5-1 s of CPU): the index is built from Arrow buffers
    (format/arrownp.py). The dataset is still whole: the clash gets distinct keys, the bad files are rejected."""
    import json
    import shutil

    from shardtrain.testing.corpus import make_corpus

    corpus = make_corpus(tmp_path / "corpus", [1.0, 1.5, 2.0, 2.5, 3.0, 1.2], seed=3)
    first = sorted(corpus.glob("*.flac"))[0]
    for name in ("x y", "x_y", "dup"):
        shutil.copy(first, corpus / f"{name}.flac")
        shutil.copy(first.with_suffix(".txt"), corpus / f"{name}.txt")
    shutil.copy(first, corpus / "dup.wav")  # the same id twice
    (corpus / "bad.flac").write_bytes(b"\x00garbage" * 400)
    (corpus / "bad.txt").write_text("hello")
    shutil.copy(first, corpus / "notext.flac")
    out = tmp_path / "ds"
    probe = PROBE.replace('"s3fs")', '"s3fs", "pandas")')
    r = subprocess.run([sys.executable, "-c", probe, "pack", str(corpus), str(out), "--workers", "2",
                        "--max-samples-per-shard", "3"], capture_output=True, text=True, timeout=300)
    verdict, code, imported = r.stdout.strip().splitlines()[-1].split()
    assert (verdict, code) == ("NO-TORCH", "0"), (r.stdout, r.stderr[-1500:])
    assert "pandas" not in imported.split(","), "pack imported pandas"
    manifest = json.loads((out / "manifest.json").read_text())
    keys = set(pq_keys(out))
    assert {"x_y"} <= keys and len([k for k in keys if k.startswith("x_y")]) == 2, keys  # the clash resolved
    assert len(manifest["shards"]) >= 3
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {"bad"} <= {j.get("key") for j in rejects} and any("notext" in json.dumps(j) for j in rejects), rejects


def pq_keys(out) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(out / "index.parquet", columns=["key"]).column("key").to_pylist()
