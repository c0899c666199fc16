"""Pick the `tf.distribute` strategy that fits the environment.

The same training script should run on a laptop, a multi-GPU box, a
`TF_CONFIG` or SLURM cluster and a TPU without edits. `auto_strategy` reads the
environment, logs what it chose and why, and builds that strategy;
`describe_choice` makes the same decision without building anything (for
`keras-dist env`, dry runs and tests).

Decision order:

1. `cpu_replicas=N` given: `MirroredStrategy` over N logical CPU devices.
2. A TPU is configured (`KERAS_DIST_TPU`, `TPU_NAME` or `COLAB_TPU_ADDR`):
   `TPUStrategy`. The TPU resolver is only consulted then, so CPU and GPU
   machines never wait on a cloud metadata server.
3. `TF_CONFIG` has `ps` tasks: `ParameterServerStrategy`.
4. `TF_CONFIG` has more than one training task (chief + workers), or the SLURM
   job step has more than one task: `MultiWorkerMirroredStrategy`.
5. More than one GPU is visible: `MirroredStrategy`.
6. Otherwise the default strategy, `tf.distribute.get_strategy()`.

Multi-process strategies first wait, with a timeout, for every other task
to answer on its address (`keras_dist.cluster.wait_for_cluster`): a task that
never starts is reported by name instead of blocking TensorFlow's start-up
silently and forever.

Example:

```python
import keras_dist

strategy = keras_dist.auto_strategy()
with strategy.scope():
    model = ...
```
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping

import tensorflow as tf

from keras_dist import cluster as cluster_lib
from keras_dist._strategies import MAX_CPU_REPLICAS as MAX_CPU_REPLICAS
from keras_dist._strategies import TPU_ENV_VARS as TPU_ENV_VARS
from keras_dist._strategies import (
    check_cpu_replicas,
    cpu_mirrored,
    env_int,
    multi_worker,
    parameter_server_strategy,
    slurm_resolver,
    tpu_strategy,
    tpu_target,
)
from keras_dist._validation import check_int, check_real
from keras_dist.core import collectives, topology

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_ENV_VAR = "KERAS_DIST_STARTUP_TIMEOUT"
COLLECTIVE_TIMEOUT_ENV_VAR = cluster_lib.COLLECTIVE_TIMEOUT_ENV_VAR
# Seconds a multi-process strategy waits for the other tasks to start.
DEFAULT_STARTUP_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """The strategy `auto_strategy` picks, and why.

    Attributes:
        name: String. One of `"TPUStrategy"`, `"ParameterServerStrategy"`,
            `"MultiWorkerMirroredStrategy"`, `"MirroredStrategy"` or
            `"DefaultStrategy"` (the strategy `tf.distribute.get_strategy()`
            returns outside any scope).
        reason: String. A human explanation, e.g.
            `"TF_CONFIG names 2 training tasks (chief + workers)"`.
        resolver: String or `None`. The cluster resolver the strategy is built
            with (`"TPUClusterResolver"`, `"TFConfigClusterResolver"` or
            `"SlurmClusterResolver"`), `None` for a single-process strategy.
    """

    name: str
    reason: str
    resolver: str | None = None


def describe_choice(
    environ: Mapping[str, str] | None = None,
    *,
    num_gpus: int | None = None,
    cpu_replicas: int | None = None,
) -> StrategyChoice:
    """Returns the strategy `auto_strategy` would build, without building it.

    Nothing is initialised and no resolver is contacted; `TF_CONFIG` is
    validated with `keras_dist.cluster.parse_tf_config`.

    Args:
        environ: Mapping or `None`. The environment to read (`TF_CONFIG`,
            `SLURM_*`, TPU variables). `None` reads `os.environ`. Defaults to
            `None`.
        num_gpus: Int or `None`. Number of visible GPUs. `None` asks
            TensorFlow (`tf.config.get_visible_devices("GPU")`, which does not
            initialise the GPUs); it is only asked when no TPU or cluster is
            configured. Defaults to `None`.
        cpu_replicas: Int or `None`. As in `auto_strategy`. Defaults to `None`.

    Returns:
        A frozen `StrategyChoice` with the strategy name and the reason.

    Raises:
        ValueError: `TF_CONFIG` is malformed or describes a cluster this
            process cannot join (no `task`, a parameter-server cluster without
            a chief or worker), a `SLURM_*` count is not an integer >= 1,
            `cpu_replicas` is outside 1..`MAX_CPU_REPLICAS` (256) or is
            combined with a multi-process cluster, or `num_gpus` is negative.
        TypeError: `cpu_replicas` or `num_gpus` is not an int.

    Example:

    ```python
    >>> keras_dist.strategy.describe_choice({"SLURM_NTASKS": "4"})
    StrategyChoice(name='MultiWorkerMirroredStrategy',
                   reason='the SLURM allocation has 4 tasks (SLURM_NTASKS=4)',
                   resolver='SlurmClusterResolver')
    ```
    """
    cpu_replicas = check_cpu_replicas(cpu_replicas)
    num_gpus = check_int(
        "num_gpus",
        num_gpus,
        minimum=0,
        allow_none=True,
        hint="Use `None` to ask TensorFlow.",
    )
    env = os.environ if environ is None else environ
    if environ is None:
        tf_config = cluster_lib.parse_tf_config()
    else:
        text = env.get("TF_CONFIG", "")
        tf_config = cluster_lib.parse_tf_config(text) if text.strip() else None

    cluster_choice, note = _cluster_choice(env, tf_config)
    if cpu_replicas is not None:
        if cluster_choice is not None:
            raise ValueError(
                f"`cpu_replicas` builds a single-process MirroredStrategy, but "
                f"the environment describes a multi-process job: "
                f"{cluster_choice.reason}. Every process would train on its "
                f"own. Drop `cpu_replicas` to get a "
                f"{cluster_choice.name}, or clear TF_CONFIG / the SLURM "
                f"variables. Received: cpu_replicas={cpu_replicas}."
            )
        return StrategyChoice(
            "MirroredStrategy",
            f"cpu_replicas={cpu_replicas} asks for {cpu_replicas} logical CPU "
            "device(s)",
        )

    tpu = tpu_target(env)
    if tpu is not None:
        variable, value, _ = tpu
        return StrategyChoice(
            "TPUStrategy", f"{variable}={value!r} names a TPU", "TPUClusterResolver"
        )
    if cluster_choice is not None:
        return cluster_choice

    if num_gpus is None:
        num_gpus = len(tf.config.get_visible_devices("GPU"))
    prefix = f"{note}; " if note else ""
    if num_gpus > 1:
        return StrategyChoice(
            "MirroredStrategy", f"{prefix}{num_gpus} GPUs are visible"
        )
    if num_gpus == 1:
        reason = f"{prefix}one GPU is visible, so there is nothing to mirror"
    else:
        reason = f"{prefix}no TPU, cluster or GPU is configured"
    return StrategyChoice("DefaultStrategy", reason)


def _remembered(build):
    """Records what `auto_strategy` builds and gives it its collective keys.

    Before any variable or collective of it, so its collectives never meet
    another strategy's (`keras_dist.core.collectives.own`); the record lets
    `DistributedModel` warn about a model built outside its scope.
    """

    @functools.wraps(build)
    def auto_strategy(*args, **kwargs):
        strategy = build(*args, **kwargs)
        if isinstance(strategy, tf.distribute.Strategy):
            topology.remember_auto_strategy(strategy)
            collectives.own(strategy)
        return strategy

    return auto_strategy


@_remembered
def auto_strategy(
    cpu_replicas: int | None = None,
    *,
    startup_timeout: float | None = None,
    cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
    communication_options: tf.distribute.experimental.CommunicationOptions
    | None = None,
    collective_timeout: float | None = None,
    variable_partitioner=None,
) -> tf.distribute.Strategy:
    """Builds the `tf.distribute` strategy that fits this environment.

    The decision is `describe_choice()` (see the module docstring for the
    order); it is logged at INFO level with its reason. Multi-process
    strategies are built with the matching cluster resolver
    (`TFConfigClusterResolver` or `SlurmClusterResolver`).

    Before a `MultiWorkerMirroredStrategy` or `TPUStrategy` is built, every
    other task (or the TPU) must answer on its address within
    `startup_timeout` seconds; while waiting, a warning names the tasks
    still missing every 15 s. TensorFlow itself would wait for a missing
    worker forever, and silently.

    TensorFlow's coordination service, started with a
    `MultiWorkerMirroredStrategy`, replaces the SIGTERM handler with a
    preemption notifier that only records the signal, so a worker would
    ignore `kill` or a launcher stopping it. `auto_strategy` puts the
    previous handler back (for most scripts: terminate), so SIGTERM ends
    the worker at once, even inside a collective.

    In a parameter-server cluster (`TF_CONFIG` with `ps` tasks) the `chief`
    task gets a `ParameterServerStrategy` and is the coordinator; on a
    `worker` or `ps` task `auto_strategy` starts that task's
    `tf.distribute.Server` and serves until the job ends (the process is
    stopped then), so one script runs on every task. Train with
    `keras_dist.DistributedModel.fit` (Keras 3's own `Model.fit` does not
    support the strategy, keras-team/keras#18624).

    Args:
        cpu_replicas: Int or `None`. When set, creates that many logical CPU
            devices (`tf.config.set_logical_device_configuration`) and returns
            a `MirroredStrategy` over them, whatever GPUs or TPUs exist: real
            multi-replica code on one CPU, for development and tests. If
            TensorFlow is already initialised with at least that many logical
            CPU devices, the first `cpu_replicas` are used. At most
            `MAX_CPU_REPLICAS` (256). Defaults to `None`.
        startup_timeout: Float or `None`. Seconds a multi-process strategy
            waits for the other tasks (or a TPU) to answer before raising.
            `None` reads the `KERAS_DIST_STARTUP_TIMEOUT` environment
            variable, and without it waits `DEFAULT_STARTUP_TIMEOUT` (300 s).
            Defaults to `None`.
        cross_device_ops: `tf.distribute.CrossDeviceOps` or `None`. How a
            single-machine `MirroredStrategy` (several GPUs, or
            `cpu_replicas`) sums gradients across its devices, e.g.
            `tf.distribute.HierarchicalCopyAllReduce()` for `BF16`
            compression on GPUs (TensorFlow's NCCL all-reduce has no
            bfloat16). `None` keeps TensorFlow's choice on GPUs (NCCL where
            it can) and `ReductionToOneDevice` for `cpu_replicas`. Other
            strategies reduce their own way and do not use it (logged at
            INFO), so one script can pass both options. Defaults to `None`.
        communication_options: `tf.distribute.experimental.CommunicationOptions`
            or `None`. The collective implementation (`RING` or `NCCL`),
            `bytes_per_pack` and `timeout_seconds` (as `collective_timeout`) of a
            `MultiWorkerMirroredStrategy`; single-process strategies do not
            use it (logged at INFO). `None` keeps TensorFlow's defaults
            (`AUTO`). Defaults to `None`.
        collective_timeout: Float or `None`. Seconds one call into
            TensorFlow (a training step, an evaluation batch, a backup's
            gather) of a `MultiWorkerMirroredStrategy` worker may wait for
            the other workers: a worker whose peer is alive but no longer
            takes part (stuck in Python, deadlocked) then fails instead of
            waiting forever. One watchdog thread per process enforces it
            (`keras_dist.core.watchdog`); TensorFlow's own per-collective
            timeout (`CommunicationOptions.timeout_seconds`, also accepted
            and moved to the watchdog) costs a thread per collective and
            ends a fast loop with "Resource temporarily unavailable" within
            minutes. `None` reads the `KERAS_DIST_COLLECTIVE_TIMEOUT`
            environment variable (`keras-dist launch` sets it, 300 s unless
            told otherwise), and without it waits without limit. A peer
            whose process died or is stopped is noticed sooner, by
            TensorFlow's coordination service (its heartbeats, about 10 s).
            Make it longer than the longest step, and than the longest time
            one worker may spend outside collectives while the others wait
            (a validation pass, a backup, the first trace). Defaults to
            `None`.

        variable_partitioner: A `tf.distribute.experimental.partitioners`
            partitioner or `None`. How a `ParameterServerStrategy` splits
            large variables across the ps tasks, e.g.
            `MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)`
            for an embedding table larger than one machine; other
            strategies do not use it (logged at INFO). Defaults to `None`
            (no splitting).

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: as `describe_choice` (malformed `TF_CONFIG`, bad
            `cpu_replicas`, ...), before TensorFlow sees the environment.
        ValueError: `startup_timeout` or `KERAS_DIST_STARTUP_TIMEOUT` is
            not a finite number > 0; the same for `collective_timeout` or
            `KERAS_DIST_COLLECTIVE_TIMEOUT`, or both `collective_timeout` and
            `communication_options.timeout_seconds` are set.
        ValueError: `cross_device_ops` is `NcclAllReduce` together with
            `cpu_replicas` (NCCL sums only between GPUs).
        TypeError: `cpu_replicas` is not an int, `startup_timeout` not a
            number, `cross_device_ops` not a `tf.distribute.CrossDeviceOps`
            or `communication_options` not a `CommunicationOptions`.
        RuntimeError: TensorFlow is already initialised with fewer logical
            CPU devices than `cpu_replicas` (call `auto_strategy` first);
            a SLURM job was not started with `srun`; some task of the cluster
            did not answer within `startup_timeout` (the message names it and
            its address); or a configured TPU could not be reached.

    Example:

    ```python
    import keras_dist

    keras_dist.init_memory_growth()
    strategy = keras_dist.auto_strategy()      # or auto_strategy(cpu_replicas=4)
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="adam", loss="mse")
    model.fit(dataset)
    ```
    """
    cpu_replicas = check_cpu_replicas(cpu_replicas)
    startup_timeout = check_real(
        "startup_timeout",
        startup_timeout,
        minimum=0,
        low_open=True,
        allow_none=True,
        hint=f"It is in seconds; `None` reads {STARTUP_TIMEOUT_ENV_VAR}.",
    )
    _check_reduction_options(cpu_replicas, cross_device_ops, communication_options)
    choice = describe_choice(cpu_replicas=cpu_replicas)
    logger.info("auto_strategy chose %s: %s.", choice.name, choice.reason)
    _log_unused_options(choice, cross_device_ops, communication_options)
    if variable_partitioner is not None and choice.name != "ParameterServerStrategy":
        logger.warning(
            "auto_strategy: %s does not use variable_partitioner, which splits "
            "variables across parameter servers: it is ignored. Remove it, or "
            "run a parameter-server cluster (TF_CONFIG with `ps` tasks, "
            "`keras-dist launch --ps M`).",
            choice.name,
        )
    communication_options = _with_collective_timeout(
        communication_options, collective_timeout
    )
    if cpu_replicas is not None:
        return cpu_mirrored(cpu_replicas, cross_device_ops)
    if choice.name == "TPUStrategy":
        return tpu_strategy(os.environ, _startup_timeout(startup_timeout))
    if choice.name == "ParameterServerStrategy":
        return parameter_server_strategy(variable_partitioner)
    if choice.resolver == "SlurmClusterResolver":
        return multi_worker(
            slurm_resolver(os.environ),
            _startup_timeout(startup_timeout),
            communication_options,
        )
    if choice.name == "MultiWorkerMirroredStrategy":
        return multi_worker(
            tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            _startup_timeout(startup_timeout),
            communication_options,
        )
    if choice.name == "MirroredStrategy":
        if cross_device_ops is None:
            return tf.distribute.MirroredStrategy()
        return tf.distribute.MirroredStrategy(cross_device_ops=cross_device_ops)
    return tf.distribute.get_strategy()


def _check_reduction_options(cpu_replicas, cross_device_ops, communication_options):
    """Validates `auto_strategy`'s `cross_device_ops` and `communication_options`."""
    if cross_device_ops is not None and not isinstance(
        cross_device_ops, tf.distribute.CrossDeviceOps
    ):
        raise TypeError(
            "`cross_device_ops` must be a `tf.distribute.CrossDeviceOps` "
            "instance, e.g. `tf.distribute.HierarchicalCopyAllReduce()`. "
            f"Received: cross_device_ops={cross_device_ops!r}. Pass an "
            "instance, not the class or a name."
        )
    # The exported name is a factory; its instances are of another class.
    options_type = type(tf.distribute.experimental.CommunicationOptions())
    if communication_options is not None and not isinstance(
        communication_options, options_type
    ):
        raise TypeError(
            "`communication_options` must be a "
            "`tf.distribute.experimental.CommunicationOptions`. Received: "
            f"communication_options={communication_options!r}. Build one, e.g. "
            "`CommunicationOptions(implementation=tf.distribute.experimental."
            "CommunicationImplementation.RING)`."
        )
    if cpu_replicas is not None and isinstance(
        cross_device_ops, tf.distribute.NcclAllReduce
    ):
        raise ValueError(
            "`cross_device_ops=NcclAllReduce()` sums only between GPUs, but "
            f"`cpu_replicas={cpu_replicas}` mirrors over CPU devices. "
            f"Received: cross_device_ops={cross_device_ops!r}. Use "
            "`tf.distribute.ReductionToOneDevice()` (the default for CPU "
            "replicas) or drop `cpu_replicas` on a machine with GPUs."
        )


def _log_unused_options(choice, cross_device_ops, communication_options):
    """Says which reduction option the chosen strategy does not use."""
    single_machine = choice.name == "MirroredStrategy"
    if cross_device_ops is not None and not single_machine:
        logger.info(
            "auto_strategy: %s does not use cross_device_ops=%r (it is for a "
            "single-machine MirroredStrategy).",
            choice.name,
            cross_device_ops,
        )
    if (
        communication_options is not None
        and choice.name != "MultiWorkerMirroredStrategy"
    ):
        logger.info(
            "auto_strategy: %s does not use communication_options (they are "
            "for MultiWorkerMirroredStrategy).",
            choice.name,
        )


def _with_collective_timeout(communication_options, collective_timeout):
    """Folds `collective_timeout` (or its variable) into the options."""
    explicit = collective_timeout is not None
    collective_timeout = cluster_lib.check_collective_timeout(
        collective_timeout,
        hint=f"It is in seconds; `None` reads {COLLECTIVE_TIMEOUT_ENV_VAR}.",
    )
    if collective_timeout is None:
        collective_timeout = _seconds_from_env(
            COLLECTIVE_TIMEOUT_ENV_VAR, None, "for no collective timeout"
        )
    if collective_timeout is None:
        return communication_options
    options = communication_options or tf.distribute.experimental.CommunicationOptions()
    if options.timeout_seconds is not None:
        if explicit:
            raise ValueError(
                "Set the collective timeout once: `collective_timeout="
                f"{collective_timeout}` and `communication_options.timeout_seconds"
                f"={options.timeout_seconds}` were both given. Drop one of them."
            )
        # The options given in code win over the environment variable.
        return options
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=collective_timeout,
        implementation=options.implementation,
    )


def _seconds_from_env(name: str, default, unset_means: str):
    """Reads a positive, finite number of seconds from the environment."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(
            f"The environment variable {name} must be a finite number of "
            f"seconds > 0. Received: {name}={text!r}. Fix it, or unset it "
            f"{unset_means}."
        )
    return value


def _startup_timeout(startup_timeout):
    """Returns the start-up timeout: the argument, the variable or the default."""
    if startup_timeout is not None:
        return startup_timeout
    return _seconds_from_env(
        STARTUP_TIMEOUT_ENV_VAR,
        DEFAULT_STARTUP_TIMEOUT,
        f"to wait {DEFAULT_STARTUP_TIMEOUT:g} s",
    )


def _cluster_choice(env, tf_config):
    """Returns (multi-process StrategyChoice or None, note for local choices)."""
    if tf_config is not None:
        spec = tf_config["cluster"]
        task = tf_config.get("task")
        if task is not None and task["type"] == "evaluator":
            return None, (
                "this process is the TF_CONFIG `evaluator`, which evaluates on "
                "its own and joins no training collective"
            )
        num_ps = len(spec.get("ps", []))
        num_training = cluster_lib.num_training_tasks(tf_config)
        if num_ps:
            if not spec.get("worker") or not spec.get("chief"):
                raise ValueError(
                    "TF_CONFIG has `ps` tasks, so it describes a "
                    "parameter-server cluster, which needs one `chief` (the "
                    "coordinator that runs the training loop) and at least one "
                    f"`worker`. Received: cluster={spec!r}. Build it with "
                    "`keras_dist.cluster.local_cluster(workers=..., ps=..., "
                    "chief=True)`."
                )
            _require_task(task, spec)
            return StrategyChoice(
                "ParameterServerStrategy",
                f"TF_CONFIG has {num_ps} `ps` task(s) and "
                f"{len(spec['worker'])} worker(s)",
                "TFConfigClusterResolver",
            ), None
        if num_training > 1:
            _require_task(task, spec)
            return StrategyChoice(
                "MultiWorkerMirroredStrategy",
                f"TF_CONFIG names {num_training} training tasks (chief + "
                f"workers); this process is {task['type']}:{task.get('index', 0)}",
                "TFConfigClusterResolver",
            ), None
        # An explicit single-task TF_CONFIG wins over SLURM variables.
        return None, f"TF_CONFIG names {num_training} training task(s)"

    step_tasks = env_int(env, "SLURM_STEP_NUM_TASKS")
    job_tasks = env_int(env, "SLURM_NTASKS")
    if step_tasks is not None:
        if step_tasks > 1:
            return StrategyChoice(
                "MultiWorkerMirroredStrategy",
                f"this SLURM job step runs {step_tasks} tasks "
                f"(SLURM_STEP_NUM_TASKS={step_tasks})",
                "SlurmClusterResolver",
            ), None
        if job_tasks is not None and job_tasks > 1:
            return None, (
                f"the SLURM allocation has {job_tasks} tasks but this job step "
                "runs 1 (start the script with `srun` to use them all)"
            )
        return None, None
    if job_tasks is not None and job_tasks > 1:
        return StrategyChoice(
            "MultiWorkerMirroredStrategy",
            f"the SLURM allocation has {job_tasks} tasks (SLURM_NTASKS={job_tasks})",
            "SlurmClusterResolver",
        ), None
    return None, None


def _require_task(task, spec) -> None:
    if task is None:
        raise ValueError(
            "TF_CONFIG describes a multi-process cluster but has no `task`, so "
            "this process does not know its role. Give every process its own "
            '`"task": {"type": ..., "index": ...}`, e.g. with '
            "`keras_dist.cluster.make_tf_config(cluster, 'worker', index)`. "
            f"Received: cluster={spec!r}."
        )
