"""Builders of the strategies `keras_dist.strategy.auto_strategy` picks, and
the environment variables they read (TPU address, SLURM task counts).

`keras_dist.strategy` decides; these build, each after waiting for the
other tasks where a strategy would otherwise block on a missing one.
"""

from __future__ import annotations

import shutil
import signal
import threading

import tensorflow as tf

from keras_dist import cluster as cluster_lib
from keras_dist._validation import check_int
from keras_dist.parameter_server import serving

TPU_ENV_VARS = ("KERAS_DIST_TPU", "TPU_NAME", "COLAB_TPU_ADDR")
# Logical CPU devices `cpu_replicas` may ask for. Every one costs TensorFlow
# thread pools and start-up time; thousands take minutes to create.
MAX_CPU_REPLICAS = 256

_SLURM_STEP_VARS = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)


def multi_worker(
    resolver, startup_timeout: float, communication_options=None
) -> tf.distribute.Strategy:
    """Waits for the other tasks, then builds MultiWorkerMirroredStrategy."""
    cluster_lib.wait_for_cluster(
        resolver.cluster_spec().as_dict(),
        startup_timeout,
        resolver.task_type,
        resolver.task_id,
    )
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    options = (
        {}
        if communication_options is None
        else {"communication_options": communication_options}
    )
    built = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, **options
    )
    # TensorFlow's coordination service has installed a C handler that only
    # records SIGTERM (a preemption notice), so the process would not stop.
    # `previous` is `None` when Python did not know the handler before.
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    return built


def env_int(env, name):
    """Returns the task count in variable `name`, or `None` when unset."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(
            f"The environment variable {name} must be an integer >= 1 (a "
            f"number of SLURM tasks). Received: {name}={text!r}. Unset it or "
            "fix the job script."
        )
    return value


def tpu_target(env):
    """Returns (variable, value, TPUClusterResolver `tpu` argument) or None."""
    for variable in TPU_ENV_VARS:
        value = env.get(variable, "").strip()
        if value:
            if variable == "COLAB_TPU_ADDR" and "://" not in value:
                return variable, value, f"grpc://{value}"
            return variable, value, value
    return None


def check_cpu_replicas(cpu_replicas):
    return check_int(
        "cpu_replicas",
        cpu_replicas,
        minimum=1,
        maximum=MAX_CPU_REPLICAS,
        allow_none=True,
        hint="It is the number of logical CPU devices to mirror over.",
    )


def cpu_mirrored(cpu_replicas: int, cross_device_ops=None) -> tf.distribute.Strategy:
    if cpu_replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        configured = tf.config.get_logical_device_configuration(cpu)
        available = len(configured) if configured else 1
        if available < cpu_replicas:
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_replicas
                )
            except RuntimeError as error:
                raise RuntimeError(
                    f"`cpu_replicas={cpu_replicas}` needs {cpu_replicas} logical "
                    f"CPU devices, but TensorFlow is already initialised with "
                    f"{available} (TensorFlow said: {error}). Call "
                    f"`keras_dist.auto_strategy(cpu_replicas={cpu_replicas})` "
                    "first, before any tensor, model or strategy is created, or "
                    f"ask for at most {available} replica(s)."
                ) from error
    devices = [f"/cpu:{index}" for index in range(cpu_replicas)]
    # NCCL cannot reduce between CPU devices; say so instead of letting
    # MirroredStrategy warn about it.
    return tf.distribute.MirroredStrategy(
        devices,
        cross_device_ops=cross_device_ops or tf.distribute.ReductionToOneDevice(),
    )


def tpu_strategy(env, startup_timeout: float) -> tf.distribute.Strategy:
    variable, value, tpu = tpu_target(env)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        # Connecting to an address where no TPU answers blocks forever.
        cluster_lib.wait_for_cluster(
            resolver.cluster_spec().as_dict(),
            startup_timeout,
            task_types=sorted(resolver.cluster_spec().jobs),
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except Exception as error:
        raise RuntimeError(
            f"{variable}={value!r} is set, but no TPU could be reached through "
            f"it ({type(error).__name__}: {error}). Fix {variable}, or unset it "
            "to train on GPUs or CPUs."
        ) from error
    return tf.distribute.TPUStrategy(resolver)


def parameter_server_strategy(variable_partitioner) -> tf.distribute.Strategy:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        # The chief's coordinator drives this task; it only serves, until the
        # launcher (or the cluster's job controller) stops it.
        serving.serve(
            resolver.cluster_spec(),
            resolver.task_type,
            resolver.task_id,
            protocol=resolver.rpc_layer or "grpc",
        )
        # `serve` does not return; were it to, the script must still not go
        # on to train as if it were the coordinator.
        raise SystemExit(0)
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=variable_partitioner
    )


def slurm_resolver(env):
    missing = [name for name in _SLURM_STEP_VARS if not env.get(name)]
    if missing:
        raise RuntimeError(
            "The SLURM allocation has several tasks, but this process was not "
            f"started as one of them ({', '.join(missing)} unset). Start one "
            "process per task with `srun`, e.g. `srun python train.py`."
        )
    resolver_lib = tf.distribute.cluster_resolver
    if "CUDA_VISIBLE_DEVICES" in env or shutil.which("nvidia-smi"):
        return resolver_lib.SlurmClusterResolver()
    # SlurmClusterResolver counts GPUs with nvidia-smi and gives each task a
    # port per GPU slot, so on CPU nodes it fails or finds no task at all.
    # One slot per task, with CUDA_VISIBLE_DEVICES left alone, fixes that.
    num_tasks = env_int(env, "SLURM_STEP_NUM_TASKS")
    return resolver_lib.SlurmClusterResolver(
        gpus_per_node=num_tasks, gpus_per_task=1, auto_set_gpu=False
    )
