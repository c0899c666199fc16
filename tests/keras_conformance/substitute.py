"""Rebinds Keras's model names to keras_dist's inside one Keras test module.

`run.py` copies a test file from the installed Keras and inserts, after its
imports, `from substitute import substitute; substitute(globals())`. Only
that module's names change; the global `keras` namespace, which keras_dist
itself reads, is never patched.

- `Model`, `keras.Model`, `keras.models.Model`, `models.Model` ->
  `keras_dist.DistributedModel` (a functional call returns a
  `FunctionalDistributedModel`; `class M(keras.Model)` subclasses it).
- trainer_test's `Trainer` mixin (Keras's `TensorFlowTrainer`) ->
  `DistributedTrainer`, the same trainer with `DistributedModel`'s training
  methods.
"""

from __future__ import annotations

import types

import keras

import keras_dist
from keras_dist import models as keras_dist_models


class _ModuleProxy(types.ModuleType):
    """A stand-in for a module: its attributes, with a few replaced."""

    def __init__(self, module, **replacements):
        super().__init__(module.__name__)
        self._module = module
        self.__dict__.update(replacements)

    def __getattr__(self, name):
        return getattr(self._module, name)


def distributed_trainer():
    """`TensorFlowTrainer` with `DistributedModel`'s training methods mixed in."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return type(
        "DistributedTrainer",
        (keras_dist_models.DistributedTrainerMixin, TensorFlowTrainer),
        {},
    )


def substitute(namespace: dict) -> None:
    """Rebinds the model names in `namespace` (a test module's globals)."""
    model = keras_dist.DistributedModel
    if "Model" in namespace:
        namespace["Model"] = model
    if "Trainer" in namespace:
        namespace["Trainer"] = distributed_trainer()
    if "models" in namespace:
        namespace["models"] = _ModuleProxy(namespace["models"], Model=model)
    if "keras" in namespace:
        namespace["keras"] = _ModuleProxy(
            keras, Model=model, models=_ModuleProxy(keras.models, Model=model)
        )
