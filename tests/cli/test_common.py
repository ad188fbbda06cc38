"""Issue 22 item 4: a wrong `--data`/DATASET gets the advice that fixes it, and one exit-status convention holds
across commands (2 usage or invalid input, 1 runtime failure, 130 interrupted), documented in --help.

Every case runs the real CLI in a fresh interpreter (the error cases all in one: conftest's shardtrain_cli_many),
on real folders: a path that does not exist, a corpus of FLAC + txt that was never packed, and a pack killed
half-way (the fault seam kills the worker writing shard 1).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from shardtrain import faults
from shardtrain.testing.corpus import make_corpus

from conftest import one_error_line as _one_error_line, shardtrain_cli as _cli, shardtrain_cli_many as _cli_many


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first_contact")
    corpus = make_corpus(root / "corpus", [0.5, 0.6, 0.7, 0.8, 0.9, 1.0], seed=1)
    half = root / "half"
    p = _cli("pack", str(corpus), str(half), "--max-samples-per-shard", "2", "--workers", "1", "--no-progress",
             env={faults.ENV: "pack.shard=1:kill"})
    assert p.returncode != 0 and not (half / "manifest.json").exists(), p.stderr[-2000:]
    return {"missing": root / "no-such-dataset", "corpus": corpus, "half": half}


@pytest.mark.slow
def test_wrong_path_unpacked_corpus_and_pack_in_progress_each_get_their_fix(places):
    """Three situations, three messages, each naming the command that fixes it; the same exit status (2: invalid
    input) from inspect and bench (and train, which exited 1 before)."""
    seen = {}
    cases = [(what, command) for what in places for command in ("inspect", "bench")]
    train = ["train", "--data", str(places["missing"]), "--out", str(places["missing"].parent / "run"),
             "--max-steps", "1"]
    *runs, p_train = _cli_many(*[[c, str(places[w]), *(("--no-progress",) if c == "bench" else ())]
                                 for w, c in cases], train)  # one interpreter: the 7 commands import once
    for (what, command), p in zip(cases, runs):
        assert p.returncode == 2, (what, command, p.returncode, p.stderr[-2000:])
        line = _one_error_line(p, command)
        seen.setdefault(what, set()).add(line.split(": error: ", 1)[1])
    assert all(len(v) == 1 for v in seen.values()), seen  # every command says the same thing
    missing, corpus, half = (next(iter(seen[k])) for k in ("missing", "corpus", "half"))
    assert "check the path" in missing and "re-run" not in missing
    assert f"shardtrain pack {places['corpus']} OUTPUT" in corpus and "unpacked corpus" in corpus
    assert "re-run `shardtrain pack INPUT" in half and "wait" in half and "resumes" in half
    assert len({missing, corpus, half}) == 3
    assert p_train.returncode == 2 and missing in _one_error_line(p_train, "train"), p_train.stderr[-2000:]


def test_help_documents_the_exit_statuses_and_usage_errors_exit_2(tmp_path):
    p = _cli("--help")
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and "exit status: 0 success; 1 runtime failure" in text
    assert "2 usage or invalid input" in text and "130 interrupted" in text
    p = _cli("synth", str(tmp_path / "s"), "--n", "0", "--tone")  # a flag out of range: usage, like argparse's
    assert p.returncode == 2 and "--n must be >= 1" in p.stderr, (p.returncode, p.stderr)


def test_one_table_maps_errors_to_exit_statuses():
    """The handler's table (cli.common.exit_code): what the user must fix is 2, what failed while running is 1;
    storage's CredentialsError (a PermissionError) is configuration, not a runtime failure."""
    from shardtrain.cli.common import EXIT_FAILURE, EXIT_USAGE, exit_code
    from shardtrain.format.validate import DatasetError
    from shardtrain.load.reader import StreamError

    class CredentialsError(PermissionError):  # the name storage/retry.py gives it; matched by name
        pass

    assert exit_code(DatasetError("x")) == EXIT_USAGE
    assert exit_code(FileNotFoundError("x")) == EXIT_USAGE
    assert exit_code(CredentialsError("no keys")) == EXIT_USAGE
    assert exit_code(StreamError("outage")) == EXIT_FAILURE
    assert exit_code(TimeoutError("slow")) == EXIT_FAILURE
    assert exit_code(ZeroDivisionError()) is None  # a bug keeps its traceback


def test_one_blas_thread_is_set_for_pack_unless_the_user_chose(monkeypatch):
    import os

    from shardtrain.cli.common import one_blas_thread

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    one_blas_thread()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    one_blas_thread()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_a_quoted_tilde_path_that_exists_is_not_reported_missing(tmp_path, monkeypatch):
    """`--data '~/ds'` (quoted: the shell leaves the ~) names the folder fsspec reads; the quick missing-path check
    called it missing."""
    from shardtrain.cli.common import missing_local_path

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ds").mkdir()
    assert not missing_local_path("~/ds") and not missing_local_path("file://~/ds")
    assert missing_local_path("~/nothing") and not missing_local_path("s3://bucket/ds")
