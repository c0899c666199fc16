"""Rebinds names inside one copied Keras test module to keras_dist's pieces.

`run.py` copies a test file and inserts, after its imports,
`from substitute import substitute; substitute(globals(), "<name>")`. Only
that module's names change; the global `keras` and `tf_keras` namespaces,
which keras_dist itself reads, are never patched. The substitutions:

- `model`: `Model`, `keras.Model`, `keras.models.Model`, `models.Model` ->
  `keras_dist.DistributedModel` (a functional call returns a
  `FunctionalDistributedModel`; `class M(keras.Model)` subclasses it);
  `Sequential` (and `keras.Sequential`, `models.Sequential`) -> a
  `Sequential` with `DistributedModel`'s training methods mixed in;
  trainer_test's `Trainer` (Keras's `TensorFlowTrainer`) -> the same trainer
  with those methods.
- `optimizer`: every optimizer class Keras exports (`keras.optimizers.*`),
  except the wrappers `LossScaleOptimizer` and `MultiOptimizer`, ->
  a stand-in whose call returns
  `keras_dist.GradientAccumulationOptimizer(Cls(...), accumulation_steps=1)`.
  `LossScaleOptimizer(SGD(...))` then puts the wrapper inside.
- `optimizer-outside-loss-scale`: only `LossScaleOptimizer` -> the
  stand-in, so `LossScaleOptimizer(SGD(...))` becomes
  `GradientAccumulationOptimizer(LossScaleOptimizer(SGD(...)), 1)`.
- `tf_keras-optimizer`: every optimizer class tf_keras exports
  (`tf_keras.optimizers.*`, `.legacy.*`, `.experimental.*`) -> a stand-in
  returning `keras_dist.tf_keras.DistributedOptimizer(Cls(...))`.

A stand-in (`OptimizerStandIn`) answers `isinstance(x, Adam)` the way the
class would, is subclassed as the class itself (`class Mine(Adam)` gives a
plain `Adam` subclass) and forwards class attributes (`Adam.from_config`).
"""

from __future__ import annotations

import functools
import types


class _ModuleProxy(types.ModuleType):
    """A stand-in for a module: its attributes, some replaced.

    `rebind(value)` maps every other attribute read through the proxy (it
    turns optimizer classes into stand-ins and wraps optimizer submodules).
    """

    def __init__(self, module, rebind=None, **replacements):
        super().__init__(module.__name__)
        self._module = module
        self._rebind = rebind
        self.__dict__.update(replacements)

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if self._rebind is not None:
            value = self._rebind(value)
            # Cached so that `optimizers.SGD is optimizers.SGD` holds.
            self.__dict__[name] = value
        return value


class OptimizerStandIn:
    """Stands for an optimizer class; calling it returns a wrapped instance."""

    def __init__(self, cls, wrap):
        functools.update_wrapper(self, cls, updated=())
        self._cls = cls
        self._wrap = wrap

    def __call__(self, *args, **kwargs):
        return self._wrap(self._cls(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._cls, name)

    def __instancecheck__(self, instance):
        return isinstance(instance, self._cls)

    def __subclasscheck__(self, subclass):
        return issubclass(subclass, self._cls)

    def __mro_entries__(self, bases):
        # `class Mine(Adam)` in a test defines a plain optimizer subclass.
        return (self._cls,)

    def __repr__(self):
        return f"<stand-in for {self._cls.__qualname__}: {self._wrap.__name__}>"


def _exported_classes(modules, base):
    # Every optimizer class the modules export, less their base classes
    # (each exports its base as `Optimizer`): tests subclass those.
    classes = set()
    for module in modules:
        for name in dir(module):
            value = getattr(module, name)
            if (
                name != "Optimizer"
                and isinstance(value, type)
                and issubclass(value, base)
            ):
                classes.add(value)
    return classes


def _rebind_optimizers(namespace, classes, wrap, packages):
    """Replaces `classes` in `namespace`, also behind module attributes."""
    stand_ins = {cls: OptimizerStandIn(cls, wrap) for cls in classes}

    def rebind(value):
        if isinstance(value, type):
            return stand_ins.get(value, value)
        if isinstance(value, types.ModuleType) and _is_optimizer_path(value, packages):
            return _ModuleProxy(value, rebind)
        return value

    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        namespace[name] = rebind(value)


def _is_optimizer_path(module, packages):
    # The package roots (`keras.optimizers.SGD`) and the optimizer modules
    # (`optimizers.SGD`, `adam.Adam`): other modules stay themselves, so a
    # test that patches `backend` or `testing` patches the real one.
    name = module.__name__
    return name in packages or any(
        name.startswith(package + ".") and "optimizers" in name for package in packages
    )


def _model(namespace):
    import keras

    import keras_dist
    from keras_dist import models as keras_dist_models

    model = keras_dist.DistributedModel
    sequential = distributed_sequential()
    replacements = {"Model": model, "Sequential": sequential}
    for name, value in replacements.items():
        if name in namespace:
            namespace[name] = value
    if "Trainer" in namespace:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        namespace["Trainer"] = type(
            "DistributedTrainer",
            (keras_dist_models.DistributedTrainerMixin, TensorFlowTrainer),
            {},
        )
    if "models" in namespace:
        namespace["models"] = _ModuleProxy(namespace["models"], **replacements)
    if "keras" in namespace:
        namespace["keras"] = _ModuleProxy(
            keras, models=_ModuleProxy(keras.models, **replacements), **replacements
        )


@functools.cache
def distributed_sequential():
    """`keras.Sequential` with `DistributedModel`'s training methods."""
    import keras

    from keras_dist import models as keras_dist_models

    # Registered so that a saved model loads back as this class, as a
    # saved `DistributedModel` does.
    @keras.saving.register_keras_serializable(package="keras_dist_conformance")
    class Sequential(keras_dist_models.DistributedTrainerMixin, keras.Sequential):
        pass

    return Sequential


def _keras_optimizers(wrapped):
    import keras

    exported = _exported_classes([keras.optimizers], keras.optimizers.Optimizer)
    outer = {keras.optimizers.LossScaleOptimizer, keras.optimizers.MultiOptimizer}
    import keras_dist

    accumulator = keras_dist.GradientAccumulationOptimizer
    classes = {c for c in exported if not issubclass(c, accumulator)}
    return classes & outer if wrapped == "outer" else classes - outer


def accumulate_once(optimizer):
    import keras_dist

    return keras_dist.GradientAccumulationOptimizer(optimizer, accumulation_steps=1)


def distributed_optimizer(optimizer):
    from keras_dist.tf_keras import DistributedOptimizer

    return DistributedOptimizer(optimizer)


def _optimizer(namespace, wrapped="inner"):
    classes = _keras_optimizers(wrapped)
    _rebind_optimizers(namespace, classes, accumulate_once, ("keras", "keras.src"))


def _tf_keras_optimizer(namespace):
    import tf_keras

    optimizers = tf_keras.optimizers
    modules = [optimizers, optimizers.legacy, optimizers.experimental]
    bases = (optimizers.Optimizer, optimizers.legacy.Optimizer)
    classes = set()
    for base in bases:
        classes |= _exported_classes(modules, base)
    _rebind_optimizers(
        namespace, classes, distributed_optimizer, ("tf_keras", "tf_keras.src")
    )


SUBSTITUTIONS = {
    "model": _model,
    "optimizer": _optimizer,
    "optimizer-outside-loss-scale": functools.partial(_optimizer, wrapped="outer"),
    "tf_keras-optimizer": _tf_keras_optimizer,
}


def substitute(namespace: dict, substitution: str = "model") -> None:
    """Rebinds names in `namespace` (a test module's globals)."""
    SUBSTITUTIONS[substitution](namespace)
