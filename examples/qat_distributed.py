"""Quantization-aware training on 2 replicas, exported to an int8 TFLite model.

Shows: tensorflow-model-optimization's `quantize_model` on a tf_keras digits
CNN, trained under `MirroredStrategy` (2 logical CPU replicas from
`keras_dist.auto_strategy(cpu_replicas=2)`) with
`keras_dist.tf_keras.DistributedOptimizer`: FP16 all-reduce (half the bytes
per step) and 2 micro-steps per update. The trained QAT model converts with
`tf.lite.TFLiteConverter.from_keras_model` and `Optimize.DEFAULT` to a TFLite
model with int8 weights and activations (the fake-quant ranges learned in
training replace a representative dataset); the example runs it with the
TFLite interpreter and prints its test accuracy next to the float model's.

Needs `pip install ".[tfmot]"` in the keras_dist clone. Data: scikit-learn's
bundled digits (8x8), shuffled with a fixed seed, 1500 to train and 297 to
test.

    python examples/qat_distributed.py                      # 8 epochs
    python examples/qat_distributed.py --cpu-replicas 4     # 4 logical CPUs
    python examples/qat_distributed.py --out models/        # keep the .tflite
    python examples/qat_distributed.py --smoke              # seconds, for the tests
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_digits():
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    # The last images of the bundled set are much harder than the rest.
    order = np.random.default_rng(0).permutation(len(x))
    x = (x[order] / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    y = y[order].astype("int32")
    return x[:1500], y[:1500], x[1500:], y[1500:]


def build_cnn(tf_keras):
    return tf_keras.Sequential(
        [
            tf_keras.layers.Conv2D(16, 3, activation="relu", input_shape=(8, 8, 1)),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(64, activation="relu"),
            tf_keras.layers.Dense(10),
        ]
    )


def tflite_accuracy(flatbuffer, x_test, y_test):
    import numpy as np
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    source = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(source["index"], x_test.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(source["index"], x_test)
    interpreter.invoke()
    logits = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    return float(np.mean(np.argmax(logits, axis=1) == y_test))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--per-replica-batch", type=int, default=16)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument(
        "--cpu-replicas", type=int, default=2, help="logical CPU devices"
    )
    parser.add_argument(
        "--out", default=None, help="folder for the .tflite (default: a temp dir)"
    )
    parser.add_argument("--smoke", action="store_true", help="short run, for tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 3

    import keras_dist

    # Before anything else initialises TensorFlow: it creates the devices.
    strategy = keras_dist.auto_strategy(cpu_replicas=args.cpu_replicas)

    import tensorflow as tf
    import tf_keras

    from keras_dist.tf_keras import DistributedOptimizer, import_tfmot

    tfmot = import_tfmot()
    x, y, x_test, y_test = load_digits()
    replicas = strategy.num_replicas_in_sync
    print(
        f"digits: {len(x)} training images, {len(x_test)} test; {replicas} "
        f"replicas, FP16 all-reduce, {args.accumulation_steps} micro-steps "
        "per update"
    )
    hook = keras_dist.compression.FP16()
    with strategy.scope():
        model = tfmot.quantization.keras.quantize_model(build_cnn(tf_keras))
        model.compile(
            optimizer=DistributedOptimizer(
                tf_keras.optimizers.Adam(0.005),
                all_reduce_hook=hook,
                accumulation_steps=args.accumulation_steps,
            ),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    batch = args.per_replica_batch * replicas
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(dataset, epochs=args.epochs, verbose=2)
    stats = hook.stats()
    print(
        f"all-reduce per update: {stats.sent_bytes:,} bytes sent "
        f"({stats.ratio:.1f}x fewer than float32)"
    )

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    flatbuffer = converter.convert()
    out = args.out or tempfile.mkdtemp(prefix="qat_distributed_")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "digits_qat_int8.tflite")
    with open(path, "wb") as file:
        file.write(flatbuffer)

    _, float_accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"float accuracy: {float_accuracy:.4f}")
    print(f"tflite int8 accuracy: {tflite_accuracy(flatbuffer, x_test, y_test):.4f}")
    print(
        f"wrote {path} ({len(flatbuffer):,} bytes); the float32 weights "
        f"alone are {sum(w.numpy().nbytes for w in model.trainable_weights):,} "
        "bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
