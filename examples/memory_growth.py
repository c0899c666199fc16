"""GPU memory growth: configure it first, see what "too late" looks like.

Shows: `keras_dist.init_memory_growth()` as the first TensorFlow call of a
script, what it returns (`MemoryConfig`) and reports
(`keras_dist.memory.memory_growth_state()`), why it must come before any
tensor, model or strategy (TensorFlow fixes its device settings when it
initialises), and `keras_dist.find_max_batch_size` searching the largest
per-replica batch whose training step fits.

By default TensorFlow reserves nearly all memory of every visible GPU at its
first tensor, so a second process on the same GPU (another worker, an
evaluator, a notebook) runs out of memory. Memory growth makes TensorFlow
allocate as it goes; `--memory-limit-mb` caps each GPU instead;
`--allocator cuda_malloc_async` switches to CUDA's stream-ordered allocator.

On a machine without a GPU there is nothing to configure: the call returns an
empty `MemoryConfig` and the example says what it would have done. The
"too late" rule is then shown with the device setting a CPU does have, the
number of logical CPU replicas, and `find_max_batch_size` stops at its cap
(a CPU step does not run out of memory the way a GPU step does).

    python examples/memory_growth.py
    python examples/memory_growth.py --memory-limit-mb 4096
    python examples/memory_growth.py --allocator cuda_malloc_async
    python examples/memory_growth.py --smoke   # seconds, for the tests
"""

import argparse
import logging
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Run in a fresh process: TensorFlow initialises (a tensor), THEN the call.
LATE_CALL = """
import tensorflow as tf
tf.constant(0.0)  # TensorFlow is now initialised, GPUs included
import keras_dist
try:
    print("  late call returned", keras_dist.init_memory_growth({args}))
except RuntimeError as error:
    print("  late call raised RuntimeError:", error)
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--memory-limit-mb",
        type=int,
        default=None,
        help="cap each GPU at this many MB instead of memory growth",
    )
    parser.add_argument(
        "--allocator",
        choices=("bfc", "cuda_malloc_async"),
        default=None,
        help="GPU allocator (TF_GPU_ALLOCATOR); default: leave it as it is",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1024,
        help="largest per-replica batch find_max_batch_size tries",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_batch_size = 64

    import keras_dist

    # 1. First, before anything creates a tensor, a model or a strategy.
    print("1. keras_dist.init_memory_growth(...) as the first TensorFlow call")
    config = keras_dist.init_memory_growth(
        memory_limit_mb=args.memory_limit_mb, allocator=args.allocator
    )
    print(f"  returned {config}")

    import numpy as np
    import tensorflow as tf

    from keras_dist.memory import memory_growth_state

    print(f"  memory_growth_state() = {memory_growth_state()}")
    print(f"  TF_GPU_ALLOCATOR = {os.environ.get('TF_GPU_ALLOCATOR')!r}")
    gpus = tf.config.list_physical_devices("GPU")
    if not config.devices:
        if args.memory_limit_mb:
            would = (
                f"cap every GPU at {args.memory_limit_mb} MB (one logical device "
                "each; a cap replaces growth)"
            )
        else:
            would = (
                "turn on memory growth on every GPU: allocate as needed "
                "instead of reserving all memory up front"
            )
        if args.allocator == "cuda_malloc_async":
            would += f", and set TF_GPU_ALLOCATOR={args.allocator}"
        _say(
            "TensorFlow sees no GPU, so there was nothing to configure: the "
            "config is empty and nothing changed. On a GPU machine the call "
            f"would {would}."
        )

    # The strategy comes second. Building it initialises TensorFlow: from
    # here on, every device setting is fixed for the life of the process.
    strategy = (
        keras_dist.auto_strategy() if gpus else keras_dist.auto_strategy(cpu_replicas=2)
    )
    replicas = strategy.num_replicas_in_sync
    print(f"  then the strategy: {type(strategy).__name__}, {replicas} replicas")

    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
        h = keras.layers.Flatten()(h)
        outputs = keras.layers.Dense(10)(h)
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    for gpu in gpus[:1]:
        info = tf.config.experimental.get_memory_info("GPU:0")
        print(f"  {gpu.name} after building the model: {info} (bytes)")

    # 2. Calls after the first: the same arguments are a no-op, others refused.
    print("\n2. Calling it again in the same process")
    again = keras_dist.init_memory_growth(
        memory_limit_mb=args.memory_limit_mb, allocator=args.allocator
    )
    print(f"  same arguments: returns the first result unchanged: {again == config}")
    other_limit = 2048 if args.memory_limit_mb is None else None
    try:
        keras_dist.init_memory_growth(memory_limit_mb=other_limit)
    except RuntimeError as error:
        print("  other arguments raise RuntimeError:\n" + _indent(error))

    # 3. Too late: TensorFlow is initialised before the first call.
    print("\n3. Too late: the first call comes after TensorFlow initialised")
    call_args = ", ".join(
        f"{name}={value!r}"
        for name, value in (
            ("memory_limit_mb", args.memory_limit_mb),
            ("allocator", args.allocator),
        )
        if value is not None
    )
    late = subprocess.run(
        [sys.executable, "-c", LATE_CALL.format(args=call_args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    print(late.stdout.rstrip() or late.stderr[-2000:])
    if not gpus:
        _say(
            "No GPU here, so there is no GPU setting to refuse: the late call "
            "passes on this machine and raises RuntimeError on a GPU machine "
            "(TensorFlow: Physical devices cannot be modified after being "
            "initialized). The same rule holds for the device setting a CPU "
            "does have, the number of logical CPU devices (TensorFlow "
            "initialised with 2 above):"
        )
        try:
            keras_dist.auto_strategy(cpu_replicas=4)
        except RuntimeError as error:
            print(
                "  auto_strategy(cpu_replicas=4) raised RuntimeError:\n"
                + _indent(error)
            )

    # 4. The largest per-replica batch whose training step fits.
    print(f"\n4. keras_dist.find_max_batch_size(max_batch_size={args.max_batch_size})")

    # The search logs each trial at INFO level; show them.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  %(message)s"))
    search_logger = logging.getLogger("keras_dist.batch_size")
    search_logger.addHandler(handler)
    search_logger.setLevel(logging.INFO)

    def sample_batch(batch_size):
        x = np.random.rand(batch_size, 8, 8, 1).astype("float32")
        return x, np.random.randint(0, 10, size=(batch_size,))

    per_replica = keras_dist.find_max_batch_size(
        model, sample_batch, initial_batch_size=8, max_batch_size=args.max_batch_size
    )
    print(
        f"  per-replica batch {per_replica} (global {per_replica * replicas}), "
        "10% below the largest that ran"
    )
    if not gpus:
        _say(
            "No out-of-memory error on the CPU up to the cap of "
            f"{args.max_batch_size}: the search stopped there. On a GPU it "
            "stops at the first size that raises ResourceExhaustedError and "
            "bisects below it."
        )
    return 0


def _say(text):
    print(textwrap.fill(text, 88, initial_indent="  ", subsequent_indent="  "))


def _indent(error):
    return "\n".join(f"    {line}" if line else "" for line in str(error).splitlines())


if __name__ == "__main__":
    sys.exit(main())
