"""Per-user private folders: where every cache, mirror, lock and temp file of shardtrain lives.

    user_dir("index")   -> <tempdir>/shardtrain-<uid>/index   (0700, owned by this user, never a symlink)
                           or, when another user squats that name, ~/.cache/shardtrain/index (with a warning)
    private_dir(path)   -> an explicit folder (StreamConfig.cache_dir, index_cache_dir): created 0700 when
                           missing, else checked: a real folder (lstat), owned by this user, not writable by others

Why: the system temp folder is shared by every local user. A fixed name there can be created first by someone
else (a crafted index cache then plans batches past their budget) or be a planted symlink (a run mirror then
deletes and writes files in the victim's folder). A folder that fails the check is refused with one line naming
it and what to remove or change; nothing is deleted, followed or chmod-ed that this module did not create.
Inside a checked folder only its owner can create names, so what lies below needs no further checks.

Cost: one lstat per folder (plus a mkdir and an fstat the first time): microseconds, at open time only.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


class PrivateDirError(PermissionError):
    """A folder shardtrain would keep private data in is not private; the message says what to remove or change."""


def _problem(st: os.stat_result) -> tuple[str, str] | None:
    """(why a folder with this lstat result cannot hold private data, what fixes it), or None when it can."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (shardtrain follows none it did not create)", "remove the link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder", "remove it"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})", "its owner or root must remove it"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})", "make it yours alone (chmod go-w)"
    return None


def private_dir(path: str | os.PathLike, *, setting: str = "") -> Path:
    """`path` as a folder only this user can write: created (parents too, the last one 0700) when missing; an
    existing one must be a real folder owned by this user and not writable by group or others. Raises
    PrivateDirError naming the folder, why, and `setting` (the option that picks another folder)."""
    p = Path(path)
    created = False
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(p, 0o700)
            created = True
        except FileExistsError:  # made meanwhile by someone else: checked below like any existing folder
            pass
        st = os.lstat(p)
    problem = _problem(st)
    if problem is not None:
        alt = f", or set {setting} to a folder of your own" if setting else ""
        raise PrivateDirError(f"{p} {problem[0]}: it cannot hold shardtrain's private files; {problem[1]}{alt}")
    if created:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:  # the umask may have left group/other bits: this folder is ours, make it 0700
            if os.fstat(fd).st_ino == st.st_ino:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    return p


def _roots() -> list[Path]:
    """Candidate per-user roots, preferred first: node-local temp (shared by a node's ranks), then the home cache."""
    uid = os.geteuid()
    home_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(tempfile.gettempdir()) / f"shardtrain-{uid}", Path(home_cache) / "shardtrain"]


def user_dir(*parts: str, setting: str = "") -> Path:
    """A private folder `<root>/<parts...>` of this user, created on first use. The root is the temp folder's
    `shardtrain-<uid>`; when that name is taken by something not ours (a squatter, a symlink), it is bypassed with
    a warning for `~/.cache/shardtrain` (never used, never removed). Raises PrivateDirError when neither works."""
    errors = []
    for i, root in enumerate(_roots()):
        try:
            private_dir(root, setting=setting)
        except PrivateDirError as e:
            errors.append(str(e))
            continue
        if i:
            log.warning("%s; using %s instead", errors[0], root)
        p = root
        for part in parts:
            p = private_dir(p / part, setting=setting)
        return p
    raise PrivateDirError(" and ".join(errors))


STALE_TEMP_S = 600.0
"""A temp file of a process that is gone is removed once untouched this long: a pid can be reused by another
pid namespace sharing the temp folder (containers), whose live writer keeps its file's mtime fresh."""


def temp_file(prefix: str, suffix: str) -> tuple[int, str]:
    """(fd, path) of a new file in user_dir("tmp") (mkstemp: 0600, never an existing name) whose name carries this
    process's pid and host: `<prefix>.pid<pid>-<host hash>.<random><suffix>`. The caller removes it; a process killed
    first (SIGKILL, OOM) cannot, so files there of this host's processes that are gone are swept first (one
    listdir; what a killed S3 pack leaves is up to a whole shard, ~125 MB, per worker). The host is in the name
    because the folder may be shared (TMPDIR or the home cache on NFS), where another host's pids mean nothing."""
    folder = user_dir("tmp")
    _sweep_orphans(folder)
    return tempfile.mkstemp(prefix=f"{prefix}.pid{os.getpid()}-{_host_tag()}.", suffix=suffix, dir=folder)


_PID = re.compile(r"\.pid(\d+)-([0-9a-f]{8})\.")


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _sweep_orphans(folder: Path) -> None:
    now, host = time.time(), _host_tag()
    for n in os.listdir(folder):
        m = _PID.search(n)
        if m is None or m[2] != host or not pid_gone(int(m[1])):
            continue
        p = folder / n
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
            if now - p.lstat().st_mtime > STALE_TEMP_S:
                p.unlink()
                log.info("removed %s, a temp file of process %s, which is gone", p, m[1])


def pid_gone(pid: int) -> bool:
    """True when `pid` names no running process (what it left behind can go); False when it runs or is not ours
    to signal."""
    try:
        os.kill(pid, 0)
    except (OverflowError, PermissionError):
        return False
    except ProcessLookupError:
        return True
    return False


def remove_own_tree(path: str | os.PathLike) -> None:
    """Delete a folder this user owns (lstat: a symlink or another user's folder is left alone, with a warning)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        shutil.rmtree(path, ignore_errors=True)
    else:
        log.warning("not deleting %s: not a folder of yours", path)


class NoSpace(OSError):
    """A folder lacks the room a build needs; the message names the folder, the space needed and the space free."""


def space_error(folder: str | os.PathLike, need: int, what: str, setting: str = "", *, more: bool = False) -> NoSpace:
    """The one-line error for a folder without room: how much is needed (`more`: the estimate proved short, so
    more than that), how much is free, what to change."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = 0
    alt = f", or set {setting} to a bigger disk" if setting else ""
    how = "more than" if more else "about"
    return NoSpace(28, f"{what} needs {how} {need / 1e6:.1f} MB in {folder}, which has {free / 1e6:.1f} MB free: free "
                       f"space there{alt}")
