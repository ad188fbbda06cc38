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

