"""An exclusive lock object next to a dataset being written (`OUTPUT/_pack.lock`), locally and on S3.

    acquire_lock(OUTPUT) -> create OUTPUT/_pack.lock exclusively, holding {host, pid, time_utc, token}
                         -> LockHeld naming the holder when it exists (a stale one of a dead process on this
                            host is taken over, with a warning) -> OutputLock.release() deletes it

Why an object and not flock: the output is often an S3 prefix, where only the object store can arbitrate.
- Local paths: the holder's JSON is written to a temp file and hard-linked to the lock name; `link` fails when
  the name exists, so exactly one process creates it, and its content is complete when it appears.
- S3: a PUT with `If-None-Match: *` (s3fs `mode="create"`), which the server refuses (412) when the key
  exists; SeaweedFS 4.48 and AWS S3 both honour it (tests/storage/test_lock.py runs it against SeaweedFS). The lock is
  then read back and its token compared, which also catches a server that ignores the header when the two
  writes are not concurrent. Residual race, only on a server that ignores `If-None-Match`: two packs whose PUTs
  and read-backs interleave can both believe they hold the lock.
- Taking over a stale lock (same host, pid no longer alive) is conditional, so exactly one of several processes
  racing for it wins: each first creates the claim object `_pack.lock.takeover-<stale token>` exclusively (the
  same If-None-Match create as above: one creator per stale token), re-reads the lock (still the stale one?),
  overwrites it, reads it back, then deletes its claim. The others fail to create the claim and are refused,
  naming the new holder. Why not If-Match on the lock itself: conditional PUT/DELETE on an ETag is newer and
  not universal among S3 servers (tests/storage/test_trust_local.py probes what SeaweedFS does); If-None-Match is
  the one primitive both SeaweedFS and AWS honour, and the claim needs nothing else. A claim left by a process
  killed mid-takeover blocks takeovers of that one stale lock; the message names both objects to delete.
  A lock left by a crash on another host must be removed by hand (the message says which object).
- Leases (`ttl_s`, the trainer's `--out/_train.lease`): the holder also records `expires_unix` and renews it
  (`OutputLock.renew`, every ttl/3 from a thread of the trainer); a lease past its expiry is stale on any host, so
  a requeued job on another node takes over a dead holder's lease by the same claim as above after at most ttl_s.
  The hosts' clocks must agree to well within ttl_s (NTP); a holder that finds its lease taken over stops.
Costs: one small write and one read (two requests on S3) to acquire, one delete to release, a read and a write
per renewal.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from shardtrain.storage import fs as _fs
from shardtrain.storage.private import pid_gone

log = logging.getLogger(__name__)

LOCK_NAME = "_pack.lock"
LEASE_NAME = "_train.lease"


class LockHeld(RuntimeError):
    """Another process holds the lock; the message names it (host, pid, start time) and the lock's URL."""


class LeaseLost(RuntimeError):
    """The lease was taken over by another process (it had expired: this one stalled past ttl_s)."""


@dataclass(frozen=True, slots=True)
class OutputLock:
    url: str
    """The lock object's URL."""
    token: str
    storage_options: dict | None = field(default=None, repr=False)  # may hold keys: never in a repr
    info: dict = field(default_factory=dict, repr=False)
    """What the holder wrote (host, pid, purpose, token, time_utc, ttl_s); renew() refreshes its expiry."""

    def renew(self) -> None:
        """Push a lease's expiry ttl_s ahead; LeaseLost when another process holds it now."""
        holder = _read_holder(self.url, self.storage_options)
        if holder is None or holder.get("token") != self.token:
            raise LeaseLost(f"{self.url} is now held by {describe(holder)}: this process's lease expired "
                            "(stalled longer than its ttl) and was taken over; stopping")
        info = {**self.info, "expires_unix": time.time() + float(self.info.get("ttl_s", 0))}
        _fs.atomic_write_bytes(self.url, json.dumps(info, sort_keys=True).encode(), self.storage_options)

    def release(self) -> None:
        """Delete the lock if it is still ours (a lock taken over meanwhile is left to its new holder)."""
        holder = _read_holder(self.url, self.storage_options)
        if holder is None or holder.get("token") == self.token:
            _fs.remove(self.url, self.storage_options)

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def describe(holder: dict | None) -> str:
    """One line naming a lock's holder (values escaped: a lock object is as untrusted as anything stored)."""
    if not holder:
        return "an unknown process (the lock object is unreadable)"
    return f"pid {holder.get('pid')!r} on host {holder.get('host')!r}, since {holder.get('time_utc')!r}"


def acquire_lock(dir_url: str, storage_options: dict | None = None, *, purpose: str = "pack",
                 name: str = LOCK_NAME, ttl_s: float | None = None) -> OutputLock:
    """Create `dir_url/<name>` exclusively or raise LockHeld naming the holder. With `ttl_s` it is a lease:
    it expires ttl_s after its last renew() and is then taken over by the next caller (module docstring)."""
    url = _fs.join(dir_url, name)
    token = uuid.uuid4().hex
    info = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose, "token": token,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if ttl_s is not None:
        info.update(ttl_s=float(ttl_s), expires_unix=time.time() + float(ttl_s))
    data = json.dumps(info, sort_keys=True).encode()
    for _ in range(3):
        if _create_exclusive(url, data, storage_options):
            holder = _read_holder(url, storage_options)
            if holder is not None and holder.get("token") == token:
                return OutputLock(url=url, token=token, storage_options=storage_options, info=info)
            # the server let a second writer replace our lock object: that writer holds it
        else:
            holder = _read_holder(url, storage_options)
            if holder is None and not _fs.exists(url, storage_options):
                continue  # released between our create and our read: try again
        if _stale(holder) and _take_over(url, holder, data, token, storage_options):
            return OutputLock(url=url, token=token, storage_options=storage_options, info=info)
        holder = _read_holder(url, storage_options) or holder
        break
    claim = f" (and {_claim_url(url, holder)}, if it exists)" if _stale(holder) else ""
    exp = (holder or {}).get("expires_unix")
    if isinstance(exp, (int, float)):
        claim += f"; its lease expires in {max(0.0, exp - time.time()):.0f} s unless renewed"
    raise LockHeld(f"{dir_url} is locked by another {purpose}: {describe(holder)} holds {url}. Wait for it to "
                   f"finish; if no such process runs any more, delete {url}{claim} and re-run")


def _claim_url(url: str, holder: dict | None) -> str:
    tok = str((holder or {}).get("token", ""))
    return f"{url}.takeover-{tok if tok.isalnum() and len(tok) <= 64 else 'x'}"


def _take_over(url: str, stale: dict | None, data: bytes, token: str, storage_options: dict | None) -> bool:
    """Replace the stale lock `stale` by ours iff this process is the one that claims it (module docstring)."""
    assert stale is not None
    claim = _claim_url(url, stale)
    if not _create_exclusive(claim, data, storage_options):
        return False  # another process is taking it over (or did)
    try:
        now = _read_holder(url, storage_options)
        if now is not None and now.get("token") != stale.get("token"):
            return False  # replaced meanwhile (released by hand and taken afresh): not ours to overwrite
        why = "its lease expired" if _expired(stale) else "that process is gone"
        log.warning("taking over the stale lock %s of %s (%s)", url, describe(stale), why)
        _fs.atomic_write_bytes(url, data, storage_options)
        now = _read_holder(url, storage_options)
        return now is not None and now.get("token") == token
    finally:
        _fs.remove(claim, storage_options)


def _create_exclusive(url: str, data: bytes, storage_options: dict | None) -> bool:
    """Create `url` holding `data` unless it exists; True when this call created it."""
    fsys, path = _fs.fs_and_path(url, storage_options)
    if _fs.is_local(url):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic and exclusive: fails with FileExistsError when the lock exists
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    try:
        fsys.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except OSError as e:
        text = str(e).lower()
        if "pre-condition" in text or "precondition" in text or "412" in text:
            return False
        raise
    finally:
        fsys.invalidate_cache(path)
    return True


def _read_holder(url: str, storage_options: dict | None) -> dict | None:
    try:
        raw = _fs.read_bytes(url, storage_options)
        holder = json.loads(raw[:4096])
    except (OSError, ValueError, RecursionError):
        return None
    return holder if isinstance(holder, dict) else None


def _expired(holder: dict | None) -> bool:
    exp = (holder or {}).get("expires_unix")
    return isinstance(exp, (int, float)) and exp < time.time()


def _stale(holder: dict | None) -> bool:
    """A lease past its expiry, or a lock of a process on this host that no longer runs."""
    if _expired(holder):
        return True
    if not holder or holder.get("host") != socket.gethostname() or type(holder.get("pid")) is not int:
        return False
    return pid_gone(holder["pid"])
