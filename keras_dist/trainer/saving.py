"""What `DistributedModel` adds to Keras's saving: the hook's state, export."""

from __future__ import annotations

import logging
import weakref

import keras

from keras_dist._compat import keras_src as _compat
from keras_dist.core import aggregation

logger = logging.getLogger(__name__)

_HOOK_STATE_PREFIX = "all_reduce_hook_state_"


class SavingMixin:
    """The hook state's place in `.keras` / `.weights.h5` files; `to_keras_model`."""

    @property
    def all_reduce_hook_state(self) -> HookStateSaveable:
        """The hook's state as Keras saves it (`save_weights`, `.keras`).

        Keras's saving walks a model's attributes; this one carries the
        hook's per-replica state (error feedback, PowerSGD factors) under
        its own path in the file, beside the layers. A plain `keras.Model`
        of the same architecture has no such attribute, so it loads the
        same file and ignores the hook state: train distributed, deploy
        plain.
        """
        saveable = self._keras_dist.saveable
        if saveable is None or saveable.owner() is not self:
            saveable = HookStateSaveable(self)
            self._keras_dist.saveable = saveable
        return saveable

    def load_own_variables(self, store):
        # Files written before the hook state had its own path kept it in
        # the model's own variables, as `all_reduce_hook_state_<i>`.
        names = list(store.keys())
        legacy = [key for key in names if key.startswith(_HOOK_STATE_PREFIX)]
        if not legacy:
            super().load_own_variables(store)
            return
        super().load_own_variables(
            {k: store[k] for k in names if not k.startswith(_HOOK_STATE_PREFIX)}
        )
        self.all_reduce_hook_state.load_own_variables(
            {k[len(_HOOK_STATE_PREFIX) :]: store[k] for k in legacy}
        )

    def to_keras_model(self) -> keras.Model:
        """Returns a plain `keras.Model` with this model's layers and weights.

        For deployment where keras_dist is not installed: the result is a
        stock `keras.Model` (functional models) or the wrapped model
        (`from_model`), sharing this model's layers and variables (no
        copy), so `result.save("model.keras")` loads with stock Keras.
        Training state (the optimizer, the hook's state) stays here.

        A subclassed `DistributedModel` has its architecture in its own
        `call`: define the same class on `keras.Model` and load this model's
        weights into it (`save_weights` / `load_weights` work across the
        two, the hook state is ignored by plain Keras).

        Returns:
            A `keras.Model` that is not a `DistributedModel`.

        Raises:
            TypeError: the model is subclassed (see above).
            ValueError: the model is not built.
        """
        if not isinstance(self, _compat.Functional):
            raise TypeError(
                f"`to_keras_model` cannot export the subclassed model "
                f"{type(self).__name__!r}: its architecture is its `call` "
                "method. Define the same class on `keras.Model`, build it, and "
                "`load_weights` a file saved with `model.save_weights(...)` "
                "(plain Keras ignores the all-reduce hook state in it)."
            )
        return keras.Model(self.inputs, self.outputs, name=self.name)


class HookStateSaveable(_compat.StateSaveable):
    """Carries a model's all-reduce hook state through Keras's saving.

    `DistributedModel.all_reduce_hook_state` returns one. What is saved:
    `"sum"` state as the sum over replicas, `"first"` state as replica 0's
    copy (see `AllReduceHook.add_state`). Loading into a model whose hook
    keeps no state skips the saved state with a warning; loading into a hook
    with a different amount of state is an error.

    Args:
        model: The `DistributedModel` whose hook state this carries.
    """

    def __init__(self, model):
        # A weak reference: Keras's saving walks this object's attributes,
        # and must not walk back into the model.
        self._model = weakref.ref(model)

    def owner(self):
        """Returns the `DistributedModel` whose hook state this carries.

        A method, not an attribute: Keras's saving walks attributes.
        """
        return self._model()

    def save_own_variables(self, store):
        hook = self.owner().all_reduce_hook
        if hook.built:
            for index, variable in enumerate(hook.state_variables):
                store[str(index)] = variable.numpy()

    def load_own_variables(self, store):
        keys = sorted(store.keys(), key=int)
        if not keys:
            return
        model = self.owner()
        hook = model.all_reduce_hook
        aggregation.build_hook(
            hook, model.trainable_variables, model.distribute_strategy
        )
        state = hook.state_variables
        if not state:
            logger.warning(
                "The weights hold all-reduce hook state (%d variables), but "
                "this model's hook %r keeps none: skipped. Training goes on "
                "without the saved error feedback; register the hook the file "
                "was saved with to resume it exactly.",
                len(keys),
                hook,
            )
            return
        if len(state) != len(keys):
            raise ValueError(
                f"The saved all-reduce hook state has {len(keys)} variables but "
                f"the model's hook {hook!r} has {len(state)}. Load the weights "
                "into a model with the same hook (or call "
                "`register_all_reduce_hook` with it before loading)."
            )
        for key, variable in zip(keys, state):
            variable.assign(store[key])
