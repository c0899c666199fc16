"""Quantization-aware training and weight clustering for `tests/test_tfmot.py`.

tfmot's QAT (`quantize_model`, then an int8 TFLite model) and weight
clustering (`cluster_weights`, `strip_clustering`) on the digits CNN of
`tf_keras_workers`, trained with `keras_dist.tf_keras.DistributedOptimizer`
(FP16 all-reduce, accumulation). Module-level functions, so
`keras_dist.testing.run_workers` can run them in real worker processes.
"""

import numpy as np
import tf_keras_workers as tkw

CLUSTERS = 8


def shuffled_digits():
    """Digits, 8x8x1, shuffled with a fixed seed before the 1500/297 split.

    Unshuffled, the last 297 images are much harder than the rest (one
    device reaches only ~0.90 on them), so the split is shuffled as
    `tests/ps_worker.py` does.
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x = (x[order] / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    y = y[order].astype("int32")
    return x[:1500], y[:1500], x[1500:], y[1500:]


def compile_distributed(model, learning_rate, accumulation_steps):
    """Compiles `model` with Adam through FP16 all-reduce and accumulation.

    Call it inside the strategy's scope.
    """
    import tf_keras

    import keras_dist
    from keras_dist.tf_keras import DistributedOptimizer

    model.compile(
        optimizer=DistributedOptimizer(
            tf_keras.optimizers.Adam(learning_rate),
            all_reduce_hook=keras_dist.compression.FP16(),
            accumulation_steps=accumulation_steps,
        ),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def fit(strategy, model, epochs, micro_batch):
    import tensorflow as tf

    x, y, _, _ = shuffled_digits()
    global_micro = micro_batch * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_micro)
    model.fit(dataset, epochs=epochs, verbose=0)


def accuracy(model):
    """The tf_keras model's accuracy on the test split."""
    _, _, x_test, y_test = shuffled_digits()
    return float(model.evaluate(x_test, y_test, verbose=0)[1])


def replicas_agree(strategy, model):
    """Whether every variable of `model` is bitwise equal on every replica."""
    agree = {}
    for variable in model.weights:
        first, *rest = strategy.experimental_local_results(variable)
        agree[variable.name] = all(
            np.array_equal(first.numpy(), other.numpy()) for other in rest
        )
    return agree


def tflite_int8(model):
    """Converts a tf_keras QAT model to TFLite with int8 weights.

    `TFLiteConverter.from_keras_model` takes the tf_keras model directly
    (TF 2.21, tf_keras 2.21, tfmot 0.8.1); the QAT model's fake-quant ops
    give the ranges, so no representative dataset is needed.
    """
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    return converter.convert()


def _interpreter(flatbuffer):
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    interpreter.allocate_tensors()
    return interpreter


def tflite_kernel_dtypes(flatbuffer, model):
    """The TFLite tensors shaped like each kernel of `model`.

    TFLite stores a Conv2D kernel (h, w, in, out) as (out, h, w, in) and a
    Dense kernel (in, out) as (out, in). Returns `{layer name: [(dtype
    name, scales), ...]}`, one pair per matching tensor; the quantization
    scales are one per output channel or one per tensor, none for a float
    tensor.
    """
    shapes = {}
    for layer in model.layers:
        kernel = getattr(getattr(layer, "layer", layer), "kernel", None)
        if kernel is None:
            continue
        shape = tuple(kernel.shape)
        shapes[layer.name] = (shape[-1], *shape[:-1])
    details = _interpreter(flatbuffer).get_tensor_details()
    return {
        name: [
            (
                detail["dtype"].__name__,
                detail["quantization_parameters"]["scales"].tolist(),
            )
            for detail in details
            if tuple(detail["shape"]) == shape
        ]
        for name, shape in shapes.items()
    }


def tflite_accuracy(flatbuffer):
    """The TFLite model's accuracy on the test split (the TFLite interpreter)."""
    _, _, x_test, y_test = shuffled_digits()
    interpreter = _interpreter(flatbuffer)
    source = interpreter.get_input_details()[0]
    target = interpreter.get_output_details()[0]
    interpreter.resize_tensor_input(source["index"], x_test.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(source["index"], x_test)
    interpreter.invoke()
    logits = interpreter.get_tensor(target["index"])
    return float(np.mean(np.argmax(logits, axis=1) == y_test))


def qat_fit(strategy, epochs=5, accumulation_steps=2, micro_batch=16):
    """Quantization-aware training of the digits CNN, then int8 TFLite.

    Returns the float (QAT) model's and the TFLite model's test accuracy,
    the TFLite kernel dtypes, the flatbuffer's size, the updates, whether
    the replicas agree and the QAT model's weights.
    """
    from keras_dist.tf_keras import import_tfmot

    tfmot = import_tfmot()
    with strategy.scope():
        model = tfmot.quantization.keras.quantize_model(tkw.digits_cnn())
        compile_distributed(model, 0.005, accumulation_steps)
    fit(strategy, model, epochs, micro_batch)
    flatbuffer = tflite_int8(model)
    return {
        "float_accuracy": accuracy(model),
        "tflite_accuracy": tflite_accuracy(flatbuffer),
        "kernel_dtypes": tflite_kernel_dtypes(flatbuffer, model),
        "tflite_bytes": len(flatbuffer),
        "float_weight_bytes": sum(w.numpy().nbytes for w in model.trainable_weights),
        "updates": int(model.optimizer.iterations.numpy()),
        "replicas_agree": replicas_agree(strategy, model),
        "weights": [w.numpy() for w in model.weights],
    }


def clustered_fit(
    strategy,
    init="KMEANS_PLUS_PLUS",
    pretrain_epochs=3,
    epochs=2,
    accumulation_steps=2,
    micro_batch=16,
):
    """Clusters the digits CNN's weights into `CLUSTERS` values, fine-tuned.

    The float model is trained first (same optimizer setup), then clustered
    and fine-tuned. Returns the stripped model's test accuracy and unique
    values per kernel, whether the replicas agree and the stripped weights.
    """
    from keras_dist.tf_keras import import_tfmot

    tfmot = import_tfmot()
    clustering = tfmot.clustering.keras
    with strategy.scope():
        model = tkw.digits_cnn()
        compile_distributed(model, 0.005, accumulation_steps)
    fit(strategy, model, pretrain_epochs, micro_batch)
    with strategy.scope():
        clustered = clustering.cluster_weights(
            model,
            number_of_clusters=CLUSTERS,
            cluster_centroids_init=getattr(clustering.CentroidInitialization, init),
        )
        compile_distributed(clustered, 0.001, accumulation_steps)
    fit(strategy, clustered, epochs, micro_batch)
    agree = replicas_agree(strategy, clustered)
    stripped = clustering.strip_clustering(clustered)
    stripped.compile(metrics=["accuracy"], loss=clustered.loss)
    return {
        "accuracy": accuracy(stripped),
        "unique": {
            layer.name: int(np.unique(layer.kernel.numpy()).size)
            for layer in stripped.layers
            if hasattr(layer, "kernel")
        },
        "replicas_agree": agree,
        "weights": [w.numpy() for w in stripped.weights],
    }


def multi_worker_qat_and_clustering():
    """QAT and clustering, each on one cluster of worker processes."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return {"qat": qat_fit(strategy), "clustering": clustered_fit(strategy)}
