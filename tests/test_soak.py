"""Long runs stay flat: threads, open files and memory of every task of a
multi-worker job under `keras-dist launch` with its defaults, on the
collectives each test names (the worker writes which carried the sums).

Each test launches `tests/soak_worker.py`, which samples its process once a
second (`keras_dist.testing.ResourceSampler`) while it trains thousands of
tiny steps, phase after phase in one process. Within a phase, after its
first fifth (tracing, TensorFlow's thread pools and caches filling), the
median of its last third of samples may exceed that of its first third by
at most:

- threads: at most `THREADS` more than at the start of the window. A
  collective timeout given to TensorFlow once cost one thread per collective
  for the whole timeout (16,000 threads after 2,000 steps);
- open file descriptors: at most `FILES` more;
- resident memory: at most `RSS_BYTES` more. TensorFlow once kept a record
  of every collective call (1.5 KiB each, about 6 KB per step of this
  model: in 12,000 steps, about 38 MB between the medians of its window's
  first and last thirds; `make test-all` runs that long soak, `make test`
  the 3,000 steps that reproduce the crash, with hooks and backups).

`docs/benchmarks/soak.md` has the same measurement over longer runs.
"""

import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
from helpers import REPO_ROOT

from keras_dist import testing

WORKER = os.path.join(REPO_ROOT, "tests", "soak_worker.py")
THREADS = 4
FILES = 4
RSS_BYTES = 24 * 2**20
WARM_UP = 0.2


def soak(tmp_path, *phases, launch_args=(), env=None, timeout=900):
    """Runs the soak worker under `keras-dist launch`; returns samples by task.

    The training tasks sample themselves; a parameter server runs no
    script, so it is sampled from here, through `/proc`, as `ps-N`.
    """
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "launch",
        "--workers",
        "2",
        *launch_args,
        "--",
        sys.executable,
        WORKER,
        str(tmp_path),
        *phases,
    ]
    outside = collections.defaultdict(list)
    with open(tmp_path / "launch.log", "w+") as log:
        launcher = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})},
        )
        deadline = time.monotonic() + timeout
        try:
            while launcher.poll() is None:
                assert time.monotonic() < deadline, "the soak run timed out"
                for task, pid in parameter_servers(launcher.pid).items():
                    try:
                        usage = dataclasses.asdict(testing.resource_usage(pid))
                    except OSError:
                        continue
                    outside[task].append({"phase": "serve", "step": 0, **usage})
                time.sleep(1.0)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        log.seek(0)
        output = log.read()
    assert launcher.returncode == 0, output[-4000:]
    assert (tmp_path / "done").exists(), output[-4000:]
    wanted = (env or {}).get("KERAS_DIST_COLLECTIVES")
    if wanted and "--ps" not in launch_args:
        assert (tmp_path / "done").read_text().strip() == wanted
    for task, rows in outside.items():
        with open(tmp_path / f"{task}.jsonl", "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    samples = {}
    for name in os.listdir(tmp_path):
        if name.endswith(".jsonl"):
            with open(tmp_path / name) as handle:
                samples[name[: -len(".jsonl")]] = [json.loads(line) for line in handle]
    return samples


def parameter_servers(root: int) -> dict:
    """`{"ps-N": pid}` of the parameter-server tasks under process `root`."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
            with open(f"/proc/{name}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        if b"_ps-server" not in argv:
            continue
        task = next(
            (
                v[len(b"KERAS_DIST_TASK=") :]
                for v in environ
                if v.startswith(b"KERAS_DIST_TASK=")
            ),
            None,
        )
        if task is not None and _descends_from(int(name), root):
            found[task.decode().replace(":", "-")] = int(name)
    return found


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/stat") as handle:
                # The parent is the second field after the parenthesised name.
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def growth(window):
    """(threads, files, rss) growth: the median of the last third of the
    samples over that of the first third (a value that only spikes, while a
    fit starts or ends, is not a trend)."""
    assert len(window) >= 6, len(window)
    third = len(window) // 3
    first, last = window[:third], window[-third:]
    return tuple(
        statistics.median(s[field] for s in last)
        - statistics.median(s[field] for s in first)
        for field in ("threads", "open_files", "rss_bytes")
    )


def phase_window(samples, phase, steps):
    """The samples of a phase after its first fifth (the warm-up)."""
    return [s for s in samples if s["phase"] == phase and s["step"] >= WARM_UP * steps]


def assert_flat(windows):
    """`windows`: `{(task, phase): samples}`; each grows within the bounds."""
    report = {key: growth(window) for key, window in windows.items()}
    for key, (threads, files, rss) in report.items():
        where = f"{key}: {report}"
        assert threads <= THREADS, where
        assert files <= FILES, where
        assert rss <= RSS_BYTES, where


def training_windows(samples_by_task, phases):
    return {
        (task, phase): phase_window(samples, phase, steps)
        for task, samples in samples_by_task.items()
        for phase, steps in phases
    }


def launcher_soak(tmp_path, phases):
    """The soak under the launcher with its defaults, on TensorFlow's
    collectives, where the crash was (where PyTorch is installed, as here,
    the default is gloo, whose soak is below); checks every phase."""
    samples = soak(
        tmp_path,
        *(f"{p}:{n}" for p, n in phases),
        env={"KERAS_DIST_COLLECTIVES": "tensorflow"},
    )
    assert sorted(samples) == ["worker-0", "worker-1"]
    assert_flat(training_windows(samples, phases))
    # Every phase ran all its steps on both workers (the last sample of a
    # phase is taken after its fit, with the optimizer's step count).
    for rows in samples.values():
        last = {row["phase"]: row["step"] for row in rows}
        assert {p: last.get(p) for p, _ in phases} == dict(phases)


@pytest.mark.multiworker
@pytest.mark.slow
def test_long_fits_under_the_launcher_keep_threads_files_and_memory_flat(
    tmp_path,
):
    # The reproduction of the crash (a DistributedModel, SGD, the launcher's
    # default 300 s collective timeout; it died after ~2,000 steps, a
    # thread per collective) at 3,000 steps, then a hook each, then
    # asynchronous backups every 25 steps, each a new model in the same
    # processes, 1,500 steps each (a leaked thread or file per step or per
    # backup shows within tens of steps).
    launcher_soak(
        tmp_path,
        [("plain", 3000), ("fp16", 1500), ("powersgd", 1500), ("backup", 1500)],
    )


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_a_long_fit_under_the_launcher_keeps_memory_flat(tmp_path):
    # 12,000 steps: what the memory bound needs to see TensorFlow's old
    # per-collective records (about 6 KB per step of this model, 38 MB
    # between the window's medians).
    launcher_soak(tmp_path, [("plain", 12000)])


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_long_fit_with_the_gloo_backend_stays_flat(tmp_path):
    pytest.importorskip("torch", reason="the gloo backend needs PyTorch")
    phases = [("plain", 5000)]
    samples = soak(tmp_path, "plain:5000", env={"KERAS_DIST_COLLECTIVES": "gloo"})
    assert_flat(training_windows(samples, phases))


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_long_fit_under_parameter_servers_stays_flat(tmp_path):
    # The chief coordinates; the workers and the ps task serve, and are
    # sampled all the same (their phase label stays "start").
    phases = [("ps", 3000)]
    samples = soak(tmp_path, "ps:3000", launch_args=("--ps", "1", "--chief"))
    assert sorted(samples) == ["chief-0", "ps-0", "worker-0", "worker-1"]
    windows = training_windows({"chief-0": samples["chief-0"]}, phases)
    # The serving tasks: the run after its first third (start-up).
    for task in ("ps-0", "worker-0", "worker-1"):
        windows[(task, "serve")] = samples[task][len(samples[task]) // 3 :]
    assert_flat(windows)
