"""One writer per `backup_dir`: the `LOCK` file that says whose it is.

Two jobs writing one `backup_dir` would delete each other's backups (each
prunes what it did not write, and the first to finish removes the folder).
The chief of a job takes the folder when `fit` starts by writing `LOCK`
with its identity (`Owner`), and checks that `LOCK` still names it before
every save and before it deletes anything; it removes `LOCK` when `fit`
ends. A `LOCK` found at the start is taken over when it is stale:

- written by the same job (an earlier attempt of it, restarted by the
  launcher, Kubernetes or SLURM): the same `KERAS_DIST_JOB_ID`, or
  `SLURM_JOB_ID`, or the same cluster in `TF_CONFIG`;
- written on this host by a process that is gone (its pid is not running,
  or runs another program started later, or the machine rebooted since),
  or by this very process (a `fit` that stopped with an exception).

Otherwise `fit` stops with `BackupInUseError` naming the owner: a live
process on this host, or a process on another host (whose liveness cannot
be checked from here: if it is gone, delete `LOCK`, or give every attempt
of the job the same `KERAS_DIST_JOB_ID`).

On a local disk the lock is created with `O_EXCL`; on an object store
there is no exclusive create, so two jobs starting in the same instant may
both take it: the one whose `LOCK` was overwritten finds out at its next
save and stops, deleting nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import time
import uuid

from keras_dist.backup import files

logger = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
JOB_ID_ENV_VAR = "KERAS_DIST_JOB_ID"


class BackupInUseError(RuntimeError):
    """`backup_dir` belongs to another job (or was taken over by one)."""


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who writes a `backup_dir`.

    Attributes:
        host: String. The host name.
        pid: Int. The process id.
        started: String or `None`. The process's start time in clock ticks
            since boot (Linux `/proc`), to tell a reused pid apart.
        boot: String or `None`. The host's boot id (Linux).
        job: String or `None`. The job's identity, the same in every attempt
            of a job (see `job_id`).
        token: String. Unique to this taking of the lock.
        since: Float. When it was taken (seconds since the epoch).
    """

    host: str
    pid: int
    started: str | None
    boot: str | None
    job: str | None
    token: str
    since: float

    def describe(self) -> str:
        """`process 123 on host (job j) since <time>`."""
        job = f" (job {self.job})" if self.job else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"process {self.pid} on {self.host}{job}, since {when}"

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Owner:
        fields = json.loads(data)
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls)})


def job_id(environ=None) -> str | None:
    """The identity of this job, the same in every attempt; `None` if unknown.

    `KERAS_DIST_JOB_ID` if set, else `SLURM_JOB_ID`, else a digest of the
    cluster in `TF_CONFIG` (its tasks' addresses: a Kubernetes TFJob's
    service names stay the same when a pod is restarted; `keras-dist
    launch` picks new ports for each attempt, which the pid check covers).
    """
    environ = os.environ if environ is None else environ
    for name in (JOB_ID_ENV_VAR, "SLURM_JOB_ID"):
        if environ.get(name, "").strip():
            return f"{name}={environ[name].strip()}"
    try:
        cluster = json.loads(environ.get("TF_CONFIG") or "{}").get("cluster")
    except (ValueError, AttributeError):
        cluster = None
    if not cluster:
        return None
    text = json.dumps(cluster, sort_keys=True)
    return "TF_CONFIG cluster " + hashlib.sha256(text.encode()).hexdigest()[:12]


def _read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """Start time of process `pid` in ticks since boot (Linux), or `None`."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) may hold spaces; the fields after it do not.
    fields = text.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _boot_id() -> str | None:
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def this_process() -> Owner:
    """A new `Owner` for this process."""
    pid = os.getpid()
    return Owner(
        host=socket.gethostname(),
        pid=pid,
        started=_start_time(pid),
        boot=_boot_id(),
        job=job_id(),
        token=uuid.uuid4().hex,
        since=time.time(),
    )


def _same_process(owner: Owner, me: Owner) -> bool:
    return (owner.host, owner.boot, owner.pid, owner.started) == (
        me.host,
        me.boot,
        me.pid,
        me.started,
    )


def _is_running(owner: Owner, me: Owner) -> bool | None:
    """Whether `owner` still runs; `None` when that cannot be told here."""
    if owner.host != me.host:
        return None
    if owner.boot and me.boot and owner.boot != me.boot:
        return False  # the machine rebooted (or a pod came back elsewhere)
    if owner.pid == me.pid:
        # One before this process with the same pid (containers start at
        # small pids); this very process is `_same_process`.
        return False
    if os.path.exists("/proc/self/stat"):
        started = _start_time(owner.pid)
        return started is not None and started == owner.started
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_owner(backup_dir: str) -> Owner | None:
    """The `Owner` in `backup_dir`'s `LOCK`; `None` if there is none.

    Raises:
        ValueError: `LOCK` exists but cannot be parsed.
    """
    try:
        data = files.read_bytes(files.join(backup_dir, LOCK_FILE))
    except FileNotFoundError:
        return None
    try:
        return Owner.from_bytes(data)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"unreadable {LOCK_FILE}: {error}") from error


def acquire(backup_dir: str) -> Owner:
    """Takes `backup_dir` for this process; returns the `Owner` it wrote.

    Raises:
        BackupInUseError: another job's live (or unverifiable) process
            holds it.
    """
    files.makedirs(backup_dir)
    path = files.join(backup_dir, LOCK_FILE)
    me = this_process()
    if files.create_exclusive(path, me.to_bytes()):
        return me
    try:
        owner = read_owner(backup_dir)
    except ValueError as error:
        # Half-written by a process that died while taking it.
        logger.warning("BackupAndRestore: replacing %s (%s).", path, error)
        owner = None
    if owner is not None:
        running = _is_running(owner, me)
        if owner.job and owner.job == me.job:
            logger.info(
                "BackupAndRestore: taking over %s from an earlier attempt of "
                "this job (%s).",
                backup_dir,
                owner.describe(),
            )
        elif _same_process(owner, me):
            logger.info(
                "BackupAndRestore: taking over %s from an earlier `fit` of "
                "this process that did not end normally.",
                backup_dir,
            )
        elif running is False:
            logger.warning(
                "BackupAndRestore: %s was held by %s, which is no longer "
                "running; taking it over.",
                backup_dir,
                owner.describe(),
            )
        else:
            raise BackupInUseError(_in_use_message(backup_dir, owner, running))
    # Written whole, then switched (local) or overwritten (object store).
    if files.is_local(backup_dir):
        temporary = files.join(backup_dir, f".{LOCK_FILE}.{me.token}")
        files.write_bytes(temporary, me.to_bytes())
        files.replace(temporary, path)
    else:
        files.write_bytes(path, me.to_bytes())
    check_owned(backup_dir, me)
    return me


def _in_use_message(backup_dir: str, owner: Owner, running: bool | None) -> str:
    if running:
        state = "is running"
    else:
        state = (
            "runs on another host, so whether it still runs cannot be checked from here"
        )
    return (
        f"`backup_dir` is in use by another job: {backup_dir} belongs to "
        f"{owner.describe()}, which {state}. Two jobs writing one backup_dir "
        "would delete each other's backups. Received: "
        f"backup_dir={backup_dir!r}. Give each job its own backup_dir. If "
        f"that job is gone, delete {files.join(backup_dir, LOCK_FILE)}; if it "
        "was an earlier attempt of this job on another host, give every "
        f"attempt the same {JOB_ID_ENV_VAR} (SLURM_JOB_ID and TF_CONFIG's "
        "cluster count too)."
    )


def check_owned(backup_dir: str, owner: Owner) -> None:
    """Raises `BackupInUseError` unless `backup_dir`'s `LOCK` names `owner`."""
    try:
        found = read_owner(backup_dir)
    except (ValueError, OSError) as error:
        found, problem = None, str(error)
    else:
        problem = "it is gone" if found is None else None
    if found is not None and found.token == owner.token:
        return
    holder = found.describe() if found is not None else problem
    raise BackupInUseError(
        f"`backup_dir` {backup_dir} is no longer this job's: its "
        f"{LOCK_FILE} names {holder}, not this process ({owner.describe()}). "
        "Another job took it over; this one stops writing there and deletes "
        "nothing. Give each job its own backup_dir."
    )


def owns(backup_dir: str, owner: Owner) -> bool:
    """Whether `backup_dir`'s `LOCK` still names `owner`."""
    try:
        check_owned(backup_dir, owner)
    except BackupInUseError:
        return False
    return True


def release(backup_dir: str, owner: Owner) -> None:
    """Removes `LOCK` if it still names `owner` (someone else's stays)."""
    if owns(backup_dir, owner):
        files.remove(files.join(backup_dir, LOCK_FILE))
