"""cli/ledger.py (ledger): help names RUN; a folder that is no run is one line, exit 2 (the ledger of real runs,
killed and resumed, is tests/integration/test_ledger_run.py)."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli


def test_ledger_help():
    assert "--json" in cli_help("ledger")


def test_ledger_of_a_folder_without_ledger_is_one_line_exit_2(tmp_path):
    p = shardtrain_cli("ledger", str(tmp_path))
    assert p.returncode == 2
    line = one_error_line(p, "ledger")
    assert str(tmp_path) in line and "no ledger/ folder" in line and p.stdout == ""
