"""SLURM for real: a one-node SLURM cluster on this machine runs the script.

The module fixture installs Debian's `slurmctld`, `slurmd` and `munge` when
`srun` is missing (root and apt-get; `apt-get update` once), writes a
`slurm.conf` with one node of 2 CPUs on free ports, starts `munged`,
`slurmctld` and `slurmd` in the foreground as child processes, and stops
them when the module is done. `srun --ntasks=2 python examples/train.py`
then runs the README's script as the two tasks of a job step:
`auto_strategy()` builds a `MultiWorkerMirroredStrategy` through
`SlurmClusterResolver`, and both tasks must end with the weights of the
one-device run.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO_ROOT, example_weights, train_example

from keras_dist import cluster

pytestmark = [pytest.mark.slurm, pytest.mark.multiworker, pytest.mark.slow]

PACKAGES = ("slurmctld", "slurmd", "munge", "slurm-client")
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def _install():
    """Installs the SLURM packages with apt-get, or says why it cannot."""
    if all(shutil.which(name) for name in DAEMONS):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ):
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node SLURM cluster; the environment that reaches it."""
    _install()
    root = tmp_path_factory.mktemp("slurm")
    os.chmod(root, 0o700)
    host = socket.gethostname().split(".")[0]
    ctld_port, node_port = cluster.free_ports(2)
    (root / "munge.key").write_bytes(os.urandom(1024))
    os.chmod(root / "munge.key", 0o600)
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            root=root, host=host, ctld_port=ctld_port, node_port=node_port
        )
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = []
    try:
        daemons.append(
            _start(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={root}/munge.socket",
                    f"--key-file={root}/munge.key",
                    f"--pid-file={root}/munged.pid",
                    f"--seed-file={root}/munged.seed",
                    f"--log-file={root}/munged.log",
                ],
                env,
            )
        )
        _wait_for(lambda: (root / "munge.socket").exists(), "munged's socket", root)
        daemons.append(_start(["slurmctld", "-D", "-i"], env))
        daemons.append(_start(["slurmd", "-D"], env))
        _wait_for(lambda: _node_idle(env), "the node to be idle in sinfo", root)
        yield env
    finally:
        for process in reversed(daemons):
            _stop(process)


SLURM_CONF = """\
ClusterName=keras-dist-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _start(command, env):
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop(process):
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _node_idle(env):
    result = subprocess.run(
        ["sinfo", "--noheader", "--format=%t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.returncode == 0 and result.stdout.strip() == "idle"


def _wait_for(condition, what, root, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "".join(
                f"--- {log.name}\n{log.read_text()[-2000:]}\n"
                for log in sorted(root.glob("*.log"))
            )
            pytest.fail(f"SLURM did not come up: no {what} after {timeout} s.\n{logs}")
        time.sleep(0.5)


def _srun(env, *command, timeout=300):
    child_env = {k: v for k, v in env.items() if k != "TF_CONFIG"}
    child_env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        ["srun", "--ntasks=2", "--kill-on-bad-exit=1", *command],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def test_srun_two_tasks_equal_one_device(slurm, tmp_path):
    out = tmp_path / "slurm"
    script = os.path.join(REPO_ROOT, "examples", "train.py")
    _srun(slurm, sys.executable, script, "--epochs=2", "--hook=none", f"--out={out}")
    first = example_weights(out / "weights-worker-0.npz")
    second = example_weights(out / "weights-worker-1.npz")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    one_device = train_example(tmp_path / "one", "--epochs=2", "--hook=none")
    for got, want in zip(first, one_device):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    history = json.loads((out / "history-worker-1.json").read_text())
    assert len(history["loss"]) == 2


def test_keras_dist_env_in_a_slurm_step(slurm):
    output = _srun(slurm, sys.executable, "-m", "keras_dist", "env", timeout=120)
    assert output.count("Engine:        SLURM job step") == 2, output
    assert output.count("MultiWorkerMirroredStrategy (resolver: SlurmCluster") == 2
