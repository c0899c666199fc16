"""Checks the Keras backend without importing Keras."""

from __future__ import annotations

import json
import os
import sys


def configured_backend() -> str:
    """Returns the backend Keras uses or will use in this process.

    If Keras is imported, asks it. Otherwise applies Keras's own rules: the
    `KERAS_BACKEND` variable, else `keras.json` in `KERAS_HOME` (default
    `~/.keras`), else `"tensorflow"`.
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    try:
        with open(os.path.join(home, "keras.json")) as handle:
            return json.load(handle).get("backend", "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


def legacy_keras() -> bool:
    """Whether this process runs in tf_keras mode (`TF_USE_LEGACY_KERAS`).

    TensorFlow's own test (tensorflow/python/util/lazy_loader.py): with it,
    `tf.keras` is tf_keras and `import tensorflow` loads no Keras 3.
    """
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def check_backend() -> None:
    """Raises ImportError unless Keras runs on the TensorFlow backend."""
    backend = configured_backend()
    if backend != "tensorflow":
        raise ImportError(
            "keras_dist needs Keras on the TensorFlow backend, but Keras is "
            f"configured for {backend!r}. Set the environment variable "
            "KERAS_BACKEND=tensorflow before importing keras (or set "
            '"backend": "tensorflow" in ~/.keras/keras.json).'
        )
