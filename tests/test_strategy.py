"""Tests for keras_dist.strategy.

The decision (`describe_choice`) is tested with fake environments. Building is
tested in this process where TensorFlow's state allows it (conftest has already
initialised 4 logical CPU devices), with recording stand-ins for strategies
that need other processes, and in one fresh subprocess for what needs an
uninitialised TensorFlow.
"""

import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import run_python

from keras_dist import _strategies, cluster, strategy

ENV_VARS = (
    "TF_CONFIG",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    *strategy.TPU_ENV_VARS,
    strategy.STARTUP_TIMEOUT_ENV_VAR,
)
STRATEGY_CLASSES = (
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "TPUStrategy",
)
RESOLVERS = ("TPUClusterResolver", "SlurmClusterResolver", "TFConfigClusterResolver")


def _tf_config(spec, task_type=None, index=0):
    config = {"cluster": spec}
    if task_type is not None:
        config["task"] = {"type": task_type, "index": index}
    return json.dumps(config)


TWO_WORKERS = {"worker": ["localhost:2001", "localhost:2002"]}
PS_CLUSTER = {
    "chief": ["localhost:2000"],
    "worker": ["localhost:2001", "localhost:2002"],
    "ps": ["localhost:2003"],
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Makes every strategy and resolver constructor fail the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("describe_choice must not build anything")

    for name in STRATEGY_CLASSES:
        monkeypatch.setattr(tf.distribute, name, forbidden)
    monkeypatch.setattr(
        tf.distribute.experimental, "ParameterServerStrategy", forbidden
    )
    for name in RESOLVERS:
        monkeypatch.setattr(tf.distribute.cluster_resolver, name, forbidden)


class Calls(list):
    """Recorded strategy constructions; `waits`: `wait_for_cluster` calls."""

    def __init__(self):
        super().__init__()
        self.waits = []


@pytest.fixture
def recorded(monkeypatch):
    """Replaces multi-process strategy classes and the start-up wait with
    recorders."""
    calls = Calls()
    monkeypatch.setattr(
        cluster,
        "wait_for_cluster",
        lambda *args, **kwargs: calls.waits.append((args, kwargs)),
    )

    def recorder(name):
        def build(*args, **kwargs):
            calls.append((name, args, kwargs))
            return name

        return build

    for name in ("MultiWorkerMirroredStrategy", "MirroredStrategy", "TPUStrategy"):
        monkeypatch.setattr(tf.distribute, name, recorder(name))
    monkeypatch.setattr(
        tf.distribute.experimental,
        "ParameterServerStrategy",
        recorder("ParameterServerStrategy"),
    )
    return calls


# describe_choice: the decision, from fake environments.


def choose(environ, **kwargs):
    kwargs.setdefault("num_gpus", 0)
    return strategy.describe_choice(environ, **kwargs)


def test_nothing_configured_is_default(nothing_is_built):
    choice = choose({})
    assert choice == strategy.StrategyChoice(
        "DefaultStrategy", "no TPU, cluster or GPU is configured"
    )


def test_one_gpu_is_default(nothing_is_built):
    choice = choose({}, num_gpus=1)
    assert choice.name == "DefaultStrategy"
    assert "one GPU" in choice.reason


def test_several_gpus_mirror(nothing_is_built):
    choice = choose({}, num_gpus=4)
    assert choice.name == "MirroredStrategy"
    assert choice.reason == "4 GPUs are visible"
    assert choice.resolver is None


def test_ps_tasks_choose_parameter_server(nothing_is_built):
    choice = choose({"TF_CONFIG": _tf_config(PS_CLUSTER, "chief")}, num_gpus=2)
    assert choice.name == "ParameterServerStrategy"
    assert choice.resolver == "TFConfigClusterResolver"
    assert "1 `ps` task(s) and 2 worker(s)" in choice.reason


def test_ps_cluster_needs_chief_and_worker(nothing_is_built):
    spec = {"worker": ["localhost:2001"], "ps": ["localhost:2003"]}
    with pytest.raises(ValueError, match=r"needs one `chief`.*at least one `worker`"):
        choose({"TF_CONFIG": _tf_config(spec, "worker")})


def test_two_workers_choose_multi_worker(nothing_is_built):
    choice = choose({"TF_CONFIG": _tf_config(TWO_WORKERS, "worker", 1)}, num_gpus=8)
    assert choice.name == "MultiWorkerMirroredStrategy"
    assert choice.resolver == "TFConfigClusterResolver"
    assert "2 training tasks" in choice.reason
    assert "worker:1" in choice.reason


def test_chief_plus_worker_is_multi_worker(nothing_is_built):
    spec = cluster.local_cluster(workers=1, chief=True)
    choice = choose({"TF_CONFIG": cluster.make_tf_config(spec, "chief", 0)})
    assert choice.name == "MultiWorkerMirroredStrategy"


def test_one_worker_is_not_multi_worker(nothing_is_built):
    environ = {"TF_CONFIG": _tf_config({"worker": ["localhost:2001"]}, "worker")}
    choice = choose(environ, num_gpus=2)
    assert choice.name == "MirroredStrategy"
    assert choice.reason.startswith("TF_CONFIG names 1 training task(s); ")
    assert choose(environ).name == "DefaultStrategy"


def test_single_task_tf_config_wins_over_slurm(nothing_is_built):
    environ = {
        "TF_CONFIG": _tf_config({"worker": ["localhost:2001"]}, "worker"),
        "SLURM_NTASKS": "4",
    }
    assert choose(environ).name == "DefaultStrategy"


def test_evaluator_trains_nothing_with_the_cluster(nothing_is_built):
    environ = {"TF_CONFIG": _tf_config(TWO_WORKERS, "evaluator")}
    choice = choose(environ)
    assert choice.name == "DefaultStrategy"
    assert "`evaluator`" in choice.reason


def test_multi_worker_tf_config_needs_task(nothing_is_built):
    with pytest.raises(ValueError, match=r"has no `task`"):
        choose({"TF_CONFIG": _tf_config(TWO_WORKERS)})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"not valid JSON"),
        ('{"cluster": {"master": ["h:1"]}}', r"unknown task type 'master'"),
        (_tf_config(TWO_WORKERS, "worker", 5), r"out of range"),
    ],
)
def test_malformed_tf_config_raises(nothing_is_built, text, message):
    with pytest.raises(ValueError, match=message):
        choose({"TF_CONFIG": text})


def test_slurm_ntasks_two_is_multi_worker(nothing_is_built):
    choice = choose({"SLURM_NTASKS": "2"})
    assert choice.name == "MultiWorkerMirroredStrategy"
    assert choice.resolver == "SlurmClusterResolver"
    assert "SLURM_NTASKS=2" in choice.reason


def test_slurm_step_tasks_decide(nothing_is_built):
    step = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"}
    assert choose(step).name == "MultiWorkerMirroredStrategy"
    # The batch script itself, not started with srun: one task in this step.
    batch = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1"}
    choice = choose(batch)
    assert choice.name == "DefaultStrategy"
    assert "srun" in choice.reason


@pytest.mark.parametrize("environ", [{"SLURM_NTASKS": "1"}, {"SLURM_NTASKS": ""}])
def test_single_slurm_task_is_not_multi_worker(nothing_is_built, environ):
    assert choose(environ).name == "DefaultStrategy"


def test_slurm_count_must_be_integer(nothing_is_built):
    with pytest.raises(ValueError, match=r"SLURM_NTASKS must be an integer.*'two'"):
        choose({"SLURM_NTASKS": "two"})


@pytest.mark.parametrize("variable", ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])
@pytest.mark.parametrize("value", ["-3", "0"])
def test_slurm_count_must_be_positive(nothing_is_built, variable, value):
    # A negative count used to be taken as "one task".
    with pytest.raises(
        ValueError, match=rf"{variable} must be an integer >= 1 .*{variable}='{value}'"
    ):
        choose({variable: value})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("TPU_NAME", "my-tpu"),
        ("COLAB_TPU_ADDR", "10.0.0.2:8470"),
        ("KERAS_DIST_TPU", "local"),
    ],
)
def test_tpu_variables_choose_tpu(nothing_is_built, variable, value):
    choice = choose({variable: value, "TF_CONFIG": _tf_config(TWO_WORKERS, "worker")})
    assert choice.name == "TPUStrategy"
    assert choice.resolver == "TPUClusterResolver"
    assert variable in choice.reason


def test_empty_tpu_variable_is_ignored(nothing_is_built):
    assert choose({"TPU_NAME": " "}).name == "DefaultStrategy"


def test_colab_address_gets_grpc_scheme():
    assert _strategies.tpu_target({"COLAB_TPU_ADDR": "10.0.0.2:8470"}) == (
        "COLAB_TPU_ADDR",
        "10.0.0.2:8470",
        "grpc://10.0.0.2:8470",
    )


def test_cpu_replicas_choose_cpu_mirror(nothing_is_built):
    choice = choose({"TPU_NAME": "my-tpu"}, num_gpus=4, cpu_replicas=3)
    assert choice.name == "MirroredStrategy"
    assert "cpu_replicas=3" in choice.reason


@pytest.mark.parametrize(
    "environ",
    [
        {"TF_CONFIG": _tf_config(TWO_WORKERS, "worker")},
        {"TF_CONFIG": _tf_config(PS_CLUSTER, "chief")},
        {"SLURM_NTASKS": "2"},
    ],
)
def test_cpu_replicas_refuse_multi_process_jobs(nothing_is_built, environ):
    with pytest.raises(ValueError, match=r"`cpu_replicas` builds a single-process"):
        choose(environ, cpu_replicas=2)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-2, ValueError)])
def test_cpu_replicas_must_be_positive(value, error):
    with pytest.raises(
        error,
        match=r"`cpu_replicas` must be an int >= 1 and <= 256 or None\. .*"
        r"number of logical CPU devices to mirror over",
    ):
        choose({}, cpu_replicas=value)


def test_cpu_replicas_are_bounded():
    # 20000 logical devices used to take minutes to create.
    with pytest.raises(
        ValueError,
        match=r"`cpu_replicas` must be an int >= 1 and <= 256 or None\. "
        r"Received: cpu_replicas=20000",
    ):
        strategy.auto_strategy(cpu_replicas=20000)
    assert strategy.MAX_CPU_REPLICAS == 256


def test_cpu_replicas_accept_numpy_ints(nothing_is_built):
    choice = choose({}, cpu_replicas=np.int64(3))
    assert "cpu_replicas=3" in choice.reason


@pytest.mark.parametrize("value", [2.0, "2", True])
def test_cpu_replicas_must_be_int(value):
    with pytest.raises(TypeError, match=r"`cpu_replicas` must be an int"):
        choose({}, cpu_replicas=value)


def test_num_gpus_is_validated():
    with pytest.raises(ValueError, match=r"`num_gpus` must be an int >= 0 or None"):
        strategy.describe_choice({}, num_gpus=-1)
    with pytest.raises(TypeError, match=r"`num_gpus` must be an int"):
        strategy.describe_choice({}, num_gpus="2")


def test_reads_os_environ_by_default(monkeypatch, clean_env, nothing_is_built):
    monkeypatch.setenv("TF_CONFIG", _tf_config(TWO_WORKERS, "worker", 0))
    assert strategy.describe_choice().name == "MultiWorkerMirroredStrategy"
    monkeypatch.setenv("TF_CONFIG", "nope")
    with pytest.raises(ValueError, match=r"TF_CONFIG environment variable"):
        strategy.describe_choice()


def test_counts_visible_gpus_when_not_given(clean_env, nothing_is_built):
    expected = len(tf.config.get_visible_devices("GPU"))
    choice = strategy.describe_choice()
    assert choice.name == ("MirroredStrategy" if expected > 1 else "DefaultStrategy")


# auto_strategy in this process.


def test_default_strategy_when_nothing_configured(clean_env, caplog):
    if len(tf.config.get_visible_devices("GPU")) > 1:
        pytest.skip("this machine has several GPUs")
    with caplog.at_level(logging.INFO, logger="keras_dist.strategy"):
        built = strategy.auto_strategy()
    assert built is tf.distribute.get_strategy()
    assert "auto_strategy chose DefaultStrategy" in caplog.text


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_cpu_replicas_use_existing_logical_devices(clean_env, replicas):
    tf.config.list_logical_devices()  # TensorFlow is initialised with 4 CPUs.
    built = strategy.auto_strategy(cpu_replicas=replicas)
    assert isinstance(built, tf.distribute.MirroredStrategy)
    assert built.num_replicas_in_sync == replicas
    total = built.reduce("SUM", built.run(lambda: tf.constant(1.0)), axis=None)
    assert float(total) == replicas


def test_cpu_replicas_beyond_initialised_devices(clean_env):
    tf.config.list_logical_devices()
    with pytest.raises(RuntimeError, match=r"already initialised with 4") as info:
        strategy.auto_strategy(cpu_replicas=6)
    assert "before any tensor, model or strategy is created" in str(info.value)


def test_malformed_tf_config_fails_before_tensorflow(
    monkeypatch, clean_env, nothing_is_built
):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost"]}}')
    with pytest.raises(ValueError, match=r"not a 'host:port' string"):
        strategy.auto_strategy()


def test_multi_worker_from_tf_config(monkeypatch, clean_env, recorded):
    monkeypatch.setenv("TF_CONFIG", _tf_config(TWO_WORKERS, "worker", 1))
    assert strategy.auto_strategy() == "MultiWorkerMirroredStrategy"
    (_, _, kwargs) = recorded[0]
    resolver = kwargs["cluster_resolver"]
    assert resolver.cluster_spec().as_dict() == TWO_WORKERS
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert recorded.waits == [((TWO_WORKERS, 300.0, "worker", 1), {})]


def test_startup_timeout_argument_wins_over_variable(monkeypatch, clean_env, recorded):
    monkeypatch.setenv("TF_CONFIG", _tf_config(TWO_WORKERS, "worker", 0))
    monkeypatch.setenv(strategy.STARTUP_TIMEOUT_ENV_VAR, " 42.5 ")
    strategy.auto_strategy()
    strategy.auto_strategy(startup_timeout=np.float32(8))
    assert [args[1] for args, _ in recorded.waits] == [42.5, 8.0]


@pytest.mark.parametrize("text", ["soon", "0", "-3", "inf", "nan"])
def test_startup_timeout_variable_is_checked(monkeypatch, clean_env, recorded, text):
    monkeypatch.setenv("TF_CONFIG", _tf_config(TWO_WORKERS, "worker", 0))
    monkeypatch.setenv(strategy.STARTUP_TIMEOUT_ENV_VAR, text)
    with pytest.raises(
        ValueError,
        match=rf"KERAS_DIST_STARTUP_TIMEOUT must be a finite number of seconds "
        rf"> 0\. Received: KERAS_DIST_STARTUP_TIMEOUT='{text}'",
    ):
        strategy.auto_strategy()
    assert recorded == []


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (float("inf"), ValueError), ("8", TypeError)]
)
def test_startup_timeout_argument_is_checked(clean_env, value, error):
    with pytest.raises(error, match=r"`startup_timeout` must be a finite number > 0"):
        strategy.auto_strategy(startup_timeout=value)


def test_unreachable_tpu_address_times_out(monkeypatch, clean_env):
    def forbidden(*args, **kwargs):
        raise AssertionError("nothing answers there: no connection is made")

    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", forbidden)
    port = cluster.free_ports(1)[0]
    monkeypatch.setenv("KERAS_DIST_TPU", f"grpc://localhost:{port}")
    with pytest.raises(
        RuntimeError,
        match=rf"KERAS_DIST_TPU='grpc://localhost:{port}' is set, but no TPU could "
        rf"be reached through it \(RuntimeError: Timed out after 1\.5 s waiting "
        rf"for the cluster to start: worker:0 at localhost:{port} ",
    ):
        strategy.auto_strategy(startup_timeout=1.5)


def test_parameter_server_on_chief(monkeypatch, clean_env, recorded):
    monkeypatch.setenv("TF_CONFIG", _tf_config(PS_CLUSTER, "chief"))
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner()
    assert (
        strategy.auto_strategy(variable_partitioner=partitioner)
        == "ParameterServerStrategy"
    )
    (_, args, kwargs) = recorded[0]
    assert args[0].cluster_spec().as_dict() == PS_CLUSTER
    assert kwargs == {"variable_partitioner": partitioner}


def test_variable_partitioner_unused_outside_parameter_servers(
    clean_env, recorded, caplog
):
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner()
    with caplog.at_level(logging.INFO, logger="keras_dist.strategy"):
        strategy.auto_strategy(variable_partitioner=partitioner)
    assert "does not use variable_partitioner" in caplog.text


def test_several_gpus_mirror_all(monkeypatch, clean_env, recorded):
    fake = [
        tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in (0, 1)
    ]
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda device_type: fake)
    assert strategy.auto_strategy() == "MirroredStrategy"
    assert recorded == [("MirroredStrategy", (), {})]


def test_unreachable_tpu_is_reported(monkeypatch, clean_env, recorded):
    def unreachable(tpu):
        raise ValueError(f"no TPU named {tpu!r}")

    monkeypatch.setattr(
        tf.distribute.cluster_resolver, "TPUClusterResolver", unreachable
    )
    monkeypatch.setenv("KERAS_DIST_TPU", "my-tpu")
    with pytest.raises(RuntimeError, match=r"KERAS_DIST_TPU='my-tpu' is set, but no"):
        strategy.auto_strategy()
    assert recorded == []


def test_slurm_without_srun(monkeypatch, clean_env, recorded):
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(RuntimeError, match=r"srun python train.py"):
        strategy.auto_strategy()
    assert recorded == []


def _slurm_step(monkeypatch, rank):
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", str(rank))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "localhost")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")


def test_slurm_on_cpu_nodes(monkeypatch, clean_env, recorded):
    _slurm_step(monkeypatch, rank=1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(_strategies.shutil, "which", lambda name: None)
    assert strategy.auto_strategy() == "MultiWorkerMirroredStrategy"
    resolver = recorded[0][2]["cluster_resolver"]
    spec = resolver.cluster_spec().as_dict()
    assert spec == {"worker": ["localhost:8888", "localhost:8889"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert recorded.waits == [((spec, 300.0, "worker", 1), {})]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_slurm_on_gpu_nodes_assigns_gpus(monkeypatch, clean_env):
    _slurm_step(monkeypatch, rank=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    resolver = _strategies.slurm_resolver(os.environ)
    assert len(resolver.cluster_spec().as_dict()["worker"]) == 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


# A fresh TensorFlow, in one subprocess.

FRESH_SCRIPT = """
import json
import keras_dist  # must not initialise TensorFlow
import tensorflow as tf

out = {}
built = keras_dist.auto_strategy(cpu_replicas=2)
out["replicas"] = built.num_replicas_in_sync
out["cpus"] = len(tf.config.list_logical_devices("CPU"))
out["sum"] = float(built.reduce("SUM", built.run(lambda: tf.constant(1.5)), axis=None))
try:
    keras_dist.auto_strategy(cpu_replicas=3)
except RuntimeError as error:
    out["error"] = str(error)
out["again"] = keras_dist.auto_strategy(cpu_replicas=2).num_replicas_in_sync
print(json.dumps(out))
"""


def test_cpu_replicas_in_fresh_process():
    proc = run_python(FRESH_SCRIPT, env=dict.fromkeys(ENV_VARS), timeout=180)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2
    assert out["cpus"] == 2
    assert out["sum"] == 3.0
    assert "already initialised with 2" in out["error"]
    assert "auto_strategy(cpu_replicas=3)` first" in out["error"]
    assert out["again"] == 2
