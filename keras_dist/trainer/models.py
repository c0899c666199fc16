"""The `DistributedModel` classes: functional, subclassed and wrapped forms."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist.trainer.mixin import DistributedTrainerMixin


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedModel(DistributedTrainerMixin, keras.Model):
    """A `keras.Model` whose `fit`, `evaluate` and `predict` are correct when
    distributed.

    Change one word, `keras.Model` -> `keras_dist.DistributedModel`, and under
    any `tf.distribute` strategy:

    - `fit` and `evaluate` work under `MultiWorkerMirroredStrategy` (stock
      Keras 3 fails there, in `_maybe_symbolic_build` and when reducing the
      logs);
    - the gradients are summed over replicas once, by an all-reduce hook you
      can replace (compression), and only then clipped and applied, so
      `clipnorm` / `global_clipnorm` see the global gradient, as on one device;
    - losses and metrics in the logs are computed from the metric state of all
      replicas and workers, not averaged per-replica results.

    Build it in any of Keras's forms, under `strategy.scope()`:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        # Functional
        inputs = keras.Input((784,))
        outputs = keras.layers.Dense(10)(inputs)
        model = keras_dist.DistributedModel(inputs, outputs)

        # Subclass
        class Net(keras_dist.DistributedModel):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(10)

            def call(self, x):
                return self.dense(x)

        # Any existing model (Sequential, keras.applications, ...): same
        # layers and weights, DistributedModel's training logic.
        model = keras_dist.DistributedModel.from_model(
            keras.applications.ResNet50(weights=None)
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3)
    ```

    A custom `train_step` can call `self.apply_gradients(gradients,
    variables)` to use the same aggregation path (hook, then clipping, then
    one update).

    Args:
        all_reduce_hook: `keras_dist.compression.AllReduceHook` or `None`. How
            gradients are summed across replicas. Defaults to `None`, a plain
            sum all-reduce (`NoCompression()`).
        *args: Passed to `keras.Model` (`inputs`, `outputs`, ...).
        **kwargs: Passed to `keras.Model` (`inputs`, `outputs`, `name`, ...).
    """

    def __new__(cls, *args, **kwargs):
        if _is_functional_call(args, kwargs) and not issubclass(
            cls, _compat.Functional
        ):
            # Keras would rewrite the bases of every class up the hierarchy,
            # DistributedModel's included, for the whole process: put the
            # functional class in the user's class instead, as Keras does
            # for a direct subclass of keras.Model.
            cls = _functional_class(cls)
        return super().__new__(cls)

    def __init__(self, *args, all_reduce_hook=None, **kwargs):
        if _is_functional_call(args, kwargs) and not isinstance(
            self, _compat.Functional
        ):
            # A subclass whose own `__init__` passes inputs and outputs up
            # (`super().__init__(inputs=..., outputs=...)`): same as above.
            _functional_class(type(self))
        super().__init__(*args, all_reduce_hook=all_reduce_hook, **kwargs)

    @classmethod
    def from_model(cls, model: keras.Model, all_reduce_hook=None, name=None):
        """Returns a DistributedModel around an existing model.

        The result shares `model`'s layers and variables (no copy): training it
        trains `model`. Create `model` under the same `strategy.scope()` as the
        result, so its variables are distributed.

        Args:
            model: `keras.Model`. Any built or unbuilt model: Sequential,
                functional, subclassed, or from `keras.applications`.
            all_reduce_hook: See the class arguments. Defaults to `None`.
            name: String or `None`. Name of the wrapper. Defaults to
                `"distributed_" + model.name`.

        Returns:
            A `DistributedModel` whose `call` is `model.call`.
        """
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. Received: "
                f"model={type(model).__name__}."
            )
        if isinstance(model, DistributedModel):
            raise ValueError(
                f"`model` {model.name!r} is already a DistributedModel; use it "
                "as it is (call `register_all_reduce_hook` to change its hook)."
            )
        strategy = tf.distribute.get_strategy()
        for variable in model.variables:
            if not strategy.extended.variable_created_in_scope(variable.value):
                raise ValueError(
                    f"The variables of `model` {model.name!r} were created "
                    "outside the current strategy's scope, so they are not "
                    "distributed. Create the model inside "
                    "`with strategy.scope():` and call `from_model` there."
                )
        return WrappedModel(
            model,
            all_reduce_hook=all_reduce_hook,
            name=name or f"distributed_{model.name}",
        )

    def get_config(self):
        return self._with_hook_config(super().get_config())

    def _with_hook_config(self, config):
        # Only a hook the user gave: the default is recreated on load, and
        # saving it would make it look user-given (see `_training_hook`).
        config["all_reduce_hook"] = keras.saving.serialize_keras_object(
            self._keras_dist.user_hook
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        hook = keras.saving.deserialize_keras_object(
            config.pop("all_reduce_hook", None), custom_objects=custom_objects
        )
        model = super().from_config(config, custom_objects=custom_objects)
        if hook is not None:
            model.register_all_reduce_hook(hook)
        return model


@keras.saving.register_keras_serializable(package="keras_dist")
class FunctionalDistributedModel(DistributedModel, _compat.Functional):
    """The class `DistributedModel(inputs, outputs)` returns.

    Keras turns `Model(inputs, outputs)` into its `Functional` class; this is
    the same for `DistributedModel`, without changing `DistributedModel`'s
    own base classes (which Keras would do for a subclass called in the
    functional form). Use it through `DistributedModel(inputs, outputs)`.
    """


@keras.saving.register_keras_serializable(package="keras_dist")
class WrappedModel(DistributedModel):
    """The class `DistributedModel.from_model(model)` returns.

    Calls the wrapped model; its layers and variables are the wrapped model's.

    Args:
        model: `keras.Model` to wrap.
        all_reduce_hook: See `DistributedModel`.
        **kwargs: `keras.Model` arguments (`name`, ...).
    """

    def __init__(self, model, all_reduce_hook=None, **kwargs):
        super().__init__(all_reduce_hook=all_reduce_hook, **kwargs)
        self.model = model
        if model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def to_keras_model(self) -> keras.Model:
        """Returns the wrapped model (see `DistributedModel.to_keras_model`)."""
        return self.model

    def build(self, input_shape):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def get_config(self):
        config = keras.Model.get_config(self)
        config["model"] = keras.saving.serialize_keras_object(self.model)
        return self._with_hook_config(config)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        config["all_reduce_hook"] = keras.saving.deserialize_keras_object(
            config.get("all_reduce_hook"), custom_objects=custom_objects
        )
        return cls(**config)


def _functional_class(cls):
    """`FunctionalDistributedModel` for `DistributedModel`; else `cls`, with
    `DistributedModel` replaced by it among its bases (and theirs)."""
    if cls is DistributedModel:
        return FunctionalDistributedModel
    if cls is object or not issubclass(cls, DistributedModel):
        return cls
    if not issubclass(cls, FunctionalDistributedModel):
        cls.__bases__ = tuple(_functional_class(base) for base in cls.__bases__)
    return cls


def _is_functional_call(args, kwargs) -> bool:
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


# Keras's legacy `.h5` format names a model class by its bare name, which
# Keras looks up among the custom objects (`keras.saving.get_custom_objects`,
# a dict it documents as mutable). The classes are registered as
# `keras_dist>...` for `.keras` files; the bare names let `.h5` files load.
for _cls in (DistributedModel, FunctionalDistributedModel, WrappedModel):
    keras.saving.get_custom_objects().setdefault(_cls.__name__, _cls)
