"""storage/private.py: private per-user folders on shared machines, checked against a real second user: a folder
another user made, or planted as a symlink, is refused (or bypassed for the defaults) and never read or written.

The second user (`strtest`) is created with useradd when the tests run as root; elsewhere those tests are skipped
with the reason shown. The other process only ever runs `mkdir`/`ln -s` as that user (runuser)."""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from shardtrain.format.manifest import open_dataset
from shardtrain.load.mapped import default_root, open_mapped
from shardtrain.storage.cache import ShardCache
from shardtrain.storage import private
from shardtrain.storage.private import PrivateDirError, private_dir, user_dir
from shardtrain.train import checkpoint as ckpt


USER = "strtest"


@pytest.fixture(scope="module")
def other_user() -> str:
    """A real second local account (created once with useradd), or a visible skip where that is impossible."""
    if os.geteuid() != 0:
        pytest.skip("a second local user needs root (useradd, runuser); running as uid %d" % os.geteuid())
    if not (shutil.which("useradd") and shutil.which("runuser")):
        pytest.skip("useradd/runuser are not installed: no second local user to act as")
    if subprocess.run(["id", "-u", USER], capture_output=True).returncode != 0:
        r = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", USER], capture_output=True, text=True)
        if r.returncode != 0 and "exists" not in r.stderr:
            pytest.skip(f"useradd {USER} failed: {r.stderr.strip()}")
    return USER


def as_user(user: str, *cmd: str) -> None:
    subprocess.run(["runuser", "-u", user, "--", *cmd], check=True, capture_output=True)


@pytest.fixture
def shared():
    """A sticky world-writable folder like /tmp, reachable by the second user (pytest's tmp_path is not)."""
    d = Path(tempfile.mkdtemp(prefix="st-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_folder_another_user_made_or_planted_as_a_symlink_is_refused(other_user, shared, tmp_path, index_dataset):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    victim.chmod(0o755)
    tmp_path.chmod(0o755)  # the other user can reach the victim's folder (not write it)
    as_user(other_user, "mkdir", "-m", "777", str(shared / "squat"))
    as_user(other_user, "ln", "-s", str(victim), str(shared / "link"))

    with pytest.raises(PrivateDirError, match=r"squat belongs to uid \d+, not to you.*its owner or root must remove"):
        private_dir(shared / "squat")
    with pytest.raises(PrivateDirError, match="symbolic link"):
        ShardCache(str(shared / "link"), 1 << 20)
    with pytest.raises(PrivateDirError, match=r"link is a symbolic link.*remove the link, or set stream.index_cache"):
        open_mapped(open_dataset(index_dataset), str(shared / "link"), text=False)
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]  # nothing written, nothing deleted
    assert (victim / "precious.txt").read_text() == "mine"
    assert sorted(p.name for p in (shared / "squat").iterdir()) == []

    mine = tmp_path / "group-writable"
    mine.mkdir()
    mine.chmod(0o775)
    with pytest.raises(PrivateDirError, match="writable by other users"):
        private_dir(mine)


def test_default_folders_are_private_and_bypass_a_squatter(other_user, shared, tmp_path, index_dataset, monkeypatch,
                                                         caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = shared / f"shardtrain-{os.geteuid()}"

    # nobody there: the per-user root is made 0700 and ours; index copies, run mirrors, temp files all live in it
    for p in (Path(default_root()), ckpt.run_mirror("s3://bucket/run"), user_dir("tmp")):
        assert p.is_relative_to(root)
        st = os.lstat(root)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert ".." not in ckpt.run_mirror("s3://b/../../etc").parts

    # another user squats the name (a folder with a planted index copy) or plants a symlink to the victim's folder:
    # bypassed for ~/.cache/shardtrain with a warning, the squatted or linked folder never read, written or removed
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    tmp_path.chmod(0o755)
    victim.chmod(0o777)
    for plant, why in ((["mkdir", "-m", "777", str(root)], "belongs to uid"),
                       (["ln", "-s", str(victim), str(root)], "is a symbolic link")):
        shutil.rmtree(root) if root.is_dir() and not root.is_symlink() else root.unlink(missing_ok=True)
        as_user(other_user, *plant)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            idx_root = default_root()
        assert Path(idx_root).is_relative_to(tmp_path / "xdg") and why in caplog.text
        mi = open_mapped(open_dataset(index_dataset), idx_root, text=False)
        assert mi.folder.is_relative_to(tmp_path / "xdg")
        mirror = ckpt.run_mirror("s3://bucket/run")
        (mirror / "metrics.jsonl").write_text("{}\n")
        assert mirror.is_relative_to(tmp_path / "xdg")
        assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
        assert not root.is_symlink() or os.readlink(root) == str(victim)
        assert root.is_symlink() or list(root.iterdir()) == []


# ---- temp files a killed process leaves (temp_file) -----------------------------------------------------------
def _gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_temp_file_sweeps_old_files_of_processes_that_are_gone_and_keeps_the_rest(tmp_path, monkeypatch):
    """A killed S3 pack or checkpoint upload leaves up to a shard (~125 MB) in the temp folder; the next temp_file
    removes it, but not a live process's file, a fresh one (a pid reused in another namespace), another host's
    (a shared folder) or a foreign name."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = user_dir("tmp")
    old = time.time() - private.STALE_TEMP_S - 60
    gone = _gone_pid()
    host = private._host_tag()
    names = {"orphan": f"shard-000003.tar.pid{gone}-{host}.ab_c1.tmp", "fresh": f"ckpt.pid{gone}-{host}.xyz.pt",
             "alive": f"shard-000004.tar.pid{os.getpid()}-{host}.qq.tmp", "foreign": "notes.txt",
             "other_host": f"shard-000005.tar.pid{gone}-{'0' * 8 if host != '0' * 8 else '1' * 8}.zz.tmp"}
    for key, n in names.items():
        (folder / n).write_bytes(b"x" * 10)
        if key != "fresh":
            os.utime(folder / n, (old, old))
    fd, path = private.temp_file("shard-000007.tar", ".tmp")
    os.close(fd)
    left = sorted(os.listdir(folder))
    assert Path(path).parent == folder and Path(path).name.startswith(f"shard-000007.tar.pid{os.getpid()}-{host}.")
    assert names["orphan"] not in left
    assert {names["fresh"], names["alive"], names["foreign"], names["other_host"], Path(path).name} == set(left)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
