"""The all-reduce hook protocol shared by every gradient compressor.

Pure TensorFlow: the Keras 3 front end registers the hooks for Keras's
serialization (`keras_dist.compression`), the tf_keras front end uses them
as they are. Collectives go through `keras_dist.core.collectives`.
"""

from __future__ import annotations

import functools
import types

import tensorflow as tf

from keras_dist.core.collectives import check_bucket_bytes, plan_buckets
from keras_dist.core.hook_types import (
    DEFAULT_BUCKET_BYTES,
    SUPPORTED_DTYPES,
    CompressionStats,
    VariableSpec,
    check_gradient,
    safe_name,
    several_replicas,
    variable_name,
)


class AllReduceHook(tf.Module):
    """Base class of gradient all-reduce hooks: subclass it to write your own.

    A hook decides how the gradients of every replica are combined into the
    summed gradient that the optimizer applies. keras_dist calls it once per
    optimizer update, inside the replica context (like the body of
    `strategy.run`), with this replica's gradients; it must return the
    **sum** over all replicas of those gradients, in the same order, shapes
    and dtypes. The loss is already scaled by `1 / num_replicas_in_sync`, so
    the sum is the gradient of the global-batch mean loss.

    Inside `reduce`, issue collectives through keras_dist's collective layer
    (`keras_dist.compression.all_reduce_sum`, `all_reduce_flat`,
    `all_gather`, `all_gather_pairs`): it keeps the collectives of several
    strategies in one process apart. Every replica must issue the same
    collectives in the same order, or the job deadlocks: never put a
    collective inside a `tf.cond` or loop that runs in replica context
    (`tf.distribute.MirroredStrategy` cannot trace it; `PowerSGD` shows how to
    branch through `merge_call` instead).

    A subclass that defines `__init__` calls `super().__init__()` first (a
    hook whose `__init__` does not raises a `RuntimeError` saying so).
    Hooks are `tf.Module`s, so `name` is a reserved attribute.

    The call order is the design of PyTorch DDP communication hooks
    (`torch.distributed.algorithms.ddp_comm_hooks`), adapted to
    `tf.distribute`:

    1. `build(variables)` once, under the strategy scope, before the first
       step: create any state here with `add_state` (for example
       error-feedback residuals).
    2. `reduce(gradients, variables)` every update step, per replica.
       `gradients` may be a subset of the built variables' gradients (Keras
       drops `None` gradients): `prepare` checks them and returns each one's
       index (`variable_index`); read state with `state(name)`.
    3. `stats()` any time after `build`: bytes sent in the last step.

    State made by `add_state` is per replica: each replica reads and writes
    its own copy, TensorFlow never mirrors or aggregates it during training,
    and it is not trainable. `state(name)` returns it, `state_names` lists
    it. The hook is a `tf.Module`, so
    `tf.train.Checkpoint(hook=model.all_reduce_hook)` saves that state; see
    `add_state` for what a checkpoint holds.

    A hook belongs to one model: it knows the variable objects it was built
    for (not their names, which two models can share), and a hook with
    per-variable state refuses another model's variables.

    The built-in hooks use only this public surface (`prepare`,
    `variable_specs`, `add_state`, `state`, the collective helpers); copy
    `keras_dist/core/casts.py` or `topk.py` as a template.

    Example:

    ```python
    @keras.saving.register_keras_serializable(package="my_project")
    class HalfPrecision(keras_dist.compression.AllReduceHook):
        def reduce(self, gradients, variables):
            half = [tf.cast(g, "float16") for g in gradients]
            summed = keras_dist.compression.all_reduce_sum(half)
            return [tf.cast(s, g.dtype) for s, g in zip(summed, gradients)]

    model = keras_dist.DistributedModel(inputs, outputs,
                                        all_reduce_hook=HalfPrecision())
    ```
    """

    one_bucket_without_size = False
    """Whether `bucket_bytes=None` makes one bucket of every gradient (else
    one per dtype); see `buckets`."""

    def __init__(self, *, bucket_bytes=None):
        super().__init__()
        self._bucket_bytes = check_bucket_bytes(bucket_bytes)
        self._built = False
        # Bookkeeping lives in a namespace, out of `tf.Module`'s attribute
        # tracking (which would wrap its dicts for checkpointing); only the
        # state variables in `_state` are checkpoint dependencies, under
        # the keys `_state/<name>`.
        self._book = types.SimpleNamespace(
            specs=(),
            variables=(),
            index_by_id={},
            reduced=(),
            per_variable=set(),
            ready_order=None,
        )
        self._state = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def checked_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if "_book" not in self.__dict__:
                raise RuntimeError(_missing_super_init(type(self), cls))

        cls.__init__ = checked_init

    def __getattr__(self, name):
        # Only reached when normal lookup fails: the base's attributes are
        # missing when a subclass uses the hook before `super().__init__()`.
        # Still an AttributeError, so `hasattr` and `getattr(..., default)`
        # (which TensorFlow's tracking uses) behave as usual.
        if "_book" not in self.__dict__:
            raise AttributeError(
                f"{_missing_super_init(type(self), type(self))} (Reading "
                f"{name!r} before it.)"
            )
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        )

    @property
    def built(self) -> bool:
        """Whether `build` has run."""
        return self._built

    @property
    def bucket_bytes(self):
        """Int or `None`: the bucket size of `buckets` (see `plan_buckets`).

        The base class's default is `None` (one collective per dtype); the
        built-in hooks default to `DEFAULT_BUCKET_BYTES`.
        """
        return self._bucket_bytes

    def buckets(self, tensors) -> list:
        """Groups `tensors` into this hook's buckets, in the order to reduce.

        `plan_buckets(tensors, self.bucket_bytes, order)`: a hook issues
        one collective per bucket, bucket after bucket, so that the
        gradients the backward pass computes first travel while the others
        are still being computed. `order` is the order in which the traced
        step computes the gradients of the current `reduce`, which
        keras_dist's aggregation path reads from the graph before it calls
        `reduce` (`keras_dist.core.collectives.ready_order`); without it
        (eagerly, or `tensors` of another length) the reverse of the
        model's variables. With
        `bucket_bytes=None`, a hook whose class sets `one_bucket_without_size
        = True` (`TopK`, `DGC`, `PowerSGD`: their payloads share one buffer
        whatever the dtype) gets one bucket of every tensor instead of one
        per dtype.

        Args:
            tensors: List of tensors (or anything with a static `shape`
                and a `dtype`), in the order of the model's variables.

        Returns:
            A list of buckets, each a list of positions into `tensors`.
        """
        if self._bucket_bytes is None and self.one_bucket_without_size:
            return [list(range(len(tensors)))] if len(tensors) else []
        order = self._book.ready_order
        if order is not None and len(order) != len(tensors):
            order = None
        return plan_buckets(tensors, self._bucket_bytes, order=order)

    def set_ready_order(self, order) -> None:
        """Sets the order `buckets` follows in the next `reduce` calls.

        keras_dist's aggregation path calls it while it traces a step, with
        `keras_dist.core.collectives.ready_order` of the gradients it is
        about to give `reduce`. The order is the same on every replica
        (read from each one's trace of the same step), so the replica
        threads of a `MirroredStrategy` may set it in turn.

        Args:
            order: A list of positions into the gradients, or `None` for
                the reverse of the model's variables.
        """
        self._book.ready_order = None if order is None else tuple(order)

    @property
    def variable_specs(self) -> tuple:
        """`VariableSpec` of each variable given to `build`, in order."""
        return self._book.specs

    @property
    def state_variables(self) -> list:
        """The per-replica state variables made by `add_state`, in order."""
        return list(self._state.values())

    @property
    def per_variable_state_names(self) -> tuple:
        """Names of the state made by `add_state(per_variable=True)`: state
        that belongs to the gradients of the built variables (residuals,
        factors), as opposed to state of the hook as a whole."""
        return tuple(n for n in self._state if n in self._book.per_variable)

    @property
    def reduced_indices(self) -> tuple:
        """Indices into `variable_specs` of the last traced `reduce`.

        Recorded by `prepare`; all built variables before the first one.
        `stats` counts these.
        """
        return self._book.reduced

    @property
    def state_names(self) -> tuple:
        """The names given to `add_state`, in order."""
        return tuple(self._state)

    def state(self, name):
        """Returns the state variable made by `add_state(name, ...)`.

        Read it with `.read_value()` and write it with `.assign(...)` inside
        `reduce`: both touch this replica's copy only.

        Args:
            name: String. The name given to `add_state`.

        Returns:
            The per-replica `tf.Variable`.

        Raises:
            RuntimeError: the hook is not built (state is made in `build`).
            KeyError: the hook has no state of that name.
        """
        if name in self._state:
            return self._state[name]
        if not self._built:
            raise RuntimeError(
                f"{type(self).__name__} has no state before `build`: state is "
                f"made by `add_state` in `build`. Received: name={name!r}."
            )
        raise KeyError(
            f"{type(self).__name__} has no state named {name!r}. Known names: "
            f"{list(self._state)}. Create it with `add_state({name!r}, ...)` "
            "in `build`."
        )

    def build(self, variables) -> None:
        """Creates the hook's state for `variables` (trainable variables).

        Called once, in cross-replica context under the strategy scope.
        Subclasses that keep state override it, call `super().build` first,
        then create their state with `add_state`.

        Args:
            variables: List of the trainable variables, in gradient order.

        Raises:
            ValueError: a variable has a dtype no collective can sum.
            RuntimeError: the hook is already built.
        """
        if self._built:
            raise RuntimeError(
                f"{self!r} is already built. A hook holds state for one set of "
                "variables: give each model its own hook instance."
            )
        variables = list(variables)
        specs = []
        index_by_id = {}
        for index, variable in enumerate(variables):
            dtype = tf.as_dtype(variable.dtype)
            name = variable_name(variable)
            if dtype not in SUPPORTED_DTYPES and several_replicas():
                raise ValueError(
                    f"`variables` must have one of the dtypes "
                    f"{[d.name for d in SUPPORTED_DTYPES]}, which the "
                    f"collectives can sum. Received: variables[{index}] "
                    f"{name!r} of dtype {dtype.name!r}. Mark it "
                    "`trainable=False` or cast it to a supported dtype."
                )
            specs.append(
                VariableSpec(name, tuple(int(d) for d in variable.shape), dtype)
            )
            index_by_id.setdefault(id(variable), index)
        # The variables themselves, not their names, identify them: two
        # models can have layers of the same names, and a hook built for
        # one must not mistake the other's variables for its own. Holding
        # them also keeps their `id`s from being reused.
        self._book.variables = tuple(variables)
        self._book.index_by_id = index_by_id
        self._book.specs = tuple(specs)
        self._book.reduced = tuple(range(len(specs)))
        self._built = True

    def add_state(
        self,
        name,
        shape,
        dtype,
        initial_value=None,
        aggregation="sum",
        per_variable=True,
    ):
        """Creates a per-replica, non-trainable state variable.

        Call it from `build` (cross-replica context, under the strategy
        scope). Each replica gets its own copy
        (`synchronization=ON_READ`): in `reduce`, reads and writes touch only
        the local copy, with no communication.

        What a checkpoint holds depends on `aggregation`:

        - `"sum"`: the sum over replicas. Restoring splits it evenly over the
          replicas (of any count), so the total is kept. Use it for
          error-feedback residuals: their total is the gradient still owed
          to the model.
        - `"first"`: the first replica's copy; restoring copies it to every
          replica. Use it for state that every replica keeps identical
          (step counters, PowerSGD's warm-start matrices).

        Read it back in `reduce` with `state(name)`.

        Args:
            name: String. Unique name of the state within the hook, also its
                key in checkpoints: derive it from the variable's index (as
                `f"residual_{index}"`), not from its name, so a checkpoint
                restores into a rebuilt model whose layers got other names.
            shape: Tuple of ints.
            dtype: Dtype of the variable.
            initial_value: Tensor, callable or `None`. Initial value, the same
                on every replica. Defaults to `None`, zeros.
            aggregation: String, `"sum"` or `"first"`. See above. Defaults to
                `"sum"`.
            per_variable: Bool. Whether the state belongs to the variables
                the hook was built for (residuals, factors), so the hook
                cannot be rebuilt for other variables. `False` for state of
                the hook as a whole (a step counter): it is kept when the
                hook is rebuilt, and `add_state` with the same name, shape
                and dtype returns the existing variable. Defaults to `True`.

        Returns:
            The new variable.

        Raises:
            ValueError: bad `name` or `aggregation`.
            RuntimeError: called in replica context.

        Example:

        ```python
        class CountingSum(keras_dist.compression.AllReduceHook):
            def build(self, variables):
                super().build(variables)
                self.add_state("calls", (), "int64", aggregation="first",
                               per_variable=False)

            def reduce(self, gradients, variables):
                gradients, _ = self.prepare(gradients, variables)
                calls = self.state("calls")
                with tf.control_dependencies([calls.assign_add(1)]):
                    return keras_dist.compression.all_reduce_sum(gradients)
        ```
        """
        aggregations = {
            "sum": tf.VariableAggregation.SUM,
            "first": tf.VariableAggregation.ONLY_FIRST_REPLICA,
        }
        if aggregation not in aggregations:
            raise ValueError(
                f"`aggregation` must be one of {sorted(aggregations)}. "
                f"Received: aggregation={aggregation!r}."
            )
        existing = self._state.get(name)
        if (
            existing is not None
            and not per_variable
            and name not in self._book.per_variable
            and tuple(existing.shape) == tuple(shape)
            and existing.dtype == tf.as_dtype(dtype)
        ):
            return existing
        if existing is not None:
            raise ValueError(
                f"`name` must be unique within the hook. Received: name={name!r} "
                "twice. Add the variable's index to the name."
            )
        if (
            tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context()
        ):
            raise RuntimeError(
                "`add_state` must be called from `build` (cross-replica "
                "context, under the strategy scope), not inside `reduce`."
            )
        if initial_value is None:
            initial_value = tf.zeros(shape, dtype)
        variable = tf.Variable(
            initial_value,
            trainable=False,
            name=safe_name(name),
            dtype=dtype,
            shape=shape,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=aggregations[aggregation],
        )
        self._state[name] = variable
        if per_variable:
            self._book.per_variable.add(name)
        return variable

    def knows(self, variable) -> bool:
        """Whether `variable` is among the variables the hook was built for."""
        return self._lookup(variable) is not None

    def rebuild(self, variables) -> None:
        """Builds a hook again, for another set of variables.

        keras_dist calls it when a model's trainable variables change
        (weights created later, `trainable` switched) and the hook keeps no
        per-variable state; state made with `per_variable=False` is kept. A
        hook with per-variable state (`add_state`) cannot move to other
        variables: its state belongs to the old ones.

        Args:
            variables: List of the trainable variables, in gradient order.

        Raises:
            RuntimeError: the hook has per-variable state.
        """
        variables = list(variables)
        if self._book.per_variable:
            known = {spec.name for spec in self.variable_specs}
            if {variable_name(v) for v in variables} <= known:
                reason = (
                    "These are other variable objects with the same names: "
                    "another model's (layers named alike), or the model was "
                    "rebuilt."
                )
            else:
                reason = (
                    "Build the model fully before training (call it on a "
                    "batch, or `fit` under a strategy scope)."
                )
            raise RuntimeError(
                f"{self!r} keeps state for the {len(self.variable_specs)} "
                "variables it was built for and cannot be rebuilt for "
                f"{len(variables)} others. {reason} Give each model its own "
                "hook instance."
            )
        self._built = False
        self._book.index_by_id = {}
        self._book.variables = ()
        self.build(variables)

    def _lookup(self, variable):
        index = self._book.index_by_id.get(id(variable))
        if index is None or self._book.variables[index] is not variable:
            return None
        return index

    def variable_index(self, variable) -> int:
        """Returns the position of `variable` in the list given to `build`.

        Args:
            variable: A variable given to `build`.

        Returns:
            Int index into `variable_specs`.

        Raises:
            ValueError: `variable` was not among the built variables.
        """
        index = self._lookup(variable)
        if index is None:
            raise ValueError(
                f"`variables` must be among the {len(self.variable_specs)} "
                "variables the "
                f"hook was built for. Received: variable "
                f"{variable_name(variable)!r}. The hook knows variables by "
                "object, not by name: give each model its own hook "
                "instance, and build it on the model's trainable variables."
            )
        return index

    def prepare(self, gradients, variables, keep_sparse=False) -> tuple[list, list]:
        """Checks the arguments of `reduce`; returns dense gradients and indices.

        Call it at the start of `reduce`, before any collective: a bad
        gradient then fails the same way on every replica. It also records
        which variables this reduction covers, for `stats`.

        Args:
            gradients: List of gradient tensors.
            variables: List of the matching variables given to `build`.
            keep_sparse: Bool. Return `tf.IndexedSlices` (the gradients of
                embeddings and other gathers) as they are, checked, instead
                of densifying them. Only a hook that reduces sparse
                gradients itself sets it (`NoCompression`, the casts);
                compressing hooks work on dense tensors. Defaults to `False`.

        Returns:
            A tuple `(gradients, indices)` of the gradients (dense tensors,
            or `tf.IndexedSlices` with `keep_sparse`) and each one's index
            into `variable_specs`.

        Raises:
            RuntimeError: the hook is not built.
            ValueError: mismatched lengths, shapes or dtypes, unsupported
                dtypes, unknown variables.
        """
        if not self._built:
            raise RuntimeError(
                f"{type(self).__name__} must be built before `reduce`: call "
                "`hook.build(model.trainable_variables)` under the strategy "
                "scope (DistributedModel does it when `fit` starts)."
            )
        gradients = list(gradients)
        variables = list(variables)
        if len(gradients) != len(variables):
            raise ValueError(
                "`gradients` and `variables` must have the same length. "
                f"Received: {len(gradients)} gradients for {len(variables)} "
                "variables."
            )
        prepared = []
        indices = []
        for position, (gradient, variable) in enumerate(zip(gradients, variables)):
            index = self.variable_index(variable)
            spec = self.variable_specs[index]
            sparse = keep_sparse and isinstance(gradient, tf.IndexedSlices)
            if sparse:
                check_gradient(position, gradient.values, spec, rows=True)
                prepared.append(gradient)
                indices.append(index)
                continue
            gradient = tf.convert_to_tensor(gradient)
            check_gradient(position, gradient, spec)
            if not gradient.shape.is_fully_defined():
                # A densified `tf.IndexedSlices` (embeddings) can lose its
                # static shape; the hooks plan with static shapes.
                gradient = tf.reshape(gradient, spec.shape)
            prepared.append(gradient)
            indices.append(index)
        self._book.reduced = tuple(indices)
        return prepared, indices

    def reduce(self, gradients, variables):
        """Returns the sum over replicas of `gradients`.

        Args:
            gradients: List of this replica's gradient tensors (no `None`).
            variables: List of the matching trainable variables.

        Returns:
            List of summed gradients, one per input, same shapes and dtypes.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement `reduce(gradients, variables)`."
        )

    def stats(self) -> CompressionStats:
        """Returns the byte accounting of the last reduction.

        Counts the variables of the last traced `reduce` (all built variables
        before the first one). The default counts every gradient at its own
        dtype for both numbers (no compression); hooks that compress override
        `sent_bytes`.

        Returns:
            A `CompressionStats`.

        Raises:
            RuntimeError: the hook is not built.
        """
        if not self._built:
            raise RuntimeError(
                f"{type(self).__name__} has no statistics before `build`: build "
                "the model's hook first (`model.build_all_reduce_hook()`)."
            )
        indices = self.reduced_indices
        raw = sum(self.variable_specs[i].nbytes for i in indices)
        return CompressionStats(raw_bytes=raw, sent_bytes=self.sent_bytes(indices))

    def sent_bytes(self, indices) -> int:
        """Bytes one replica sends to reduce the gradients of `indices`.

        Override it in a compressing hook; `stats` calls it eagerly.

        Args:
            indices: Sequence of indices into `variable_specs`.

        Returns:
            Int, bytes. The default is the raw size.
        """
        return sum(self.variable_specs[i].nbytes for i in indices)

    def compression_ratio(self):
        """Returns `stats().ratio` as a float32 scalar tensor.

        Usable inside a traced train step (for the training logs). Hooks
        whose ratio changes while training (PowerSGD's `start_step`)
        override it to read their state.
        """
        return tf.constant(self.stats().ratio, tf.float32)

    def get_config(self) -> dict:
        """Returns the constructor arguments of the hook."""
        return {}

    @classmethod
    def from_config(cls, config: dict):
        """Creates a hook from `get_config`'s output."""
        return cls(**config)

    def __repr__(self):
        config = dict(self.get_config())
        # The default bucket size is left out: `FP16()` reads as it is written.
        if config.get("bucket_bytes") == DEFAULT_BUCKET_BYTES:
            del config["bucket_bytes"]
        args = ", ".join(f"{k}={v!r}" for k, v in config.items())
        return f"{type(self).__name__}({args})"


def _missing_super_init(hook_class, defining_class) -> str:
    return (
        f"{hook_class.__name__} is not initialised: `{defining_class.__name__}"
        ".__init__` must call `super().__init__()` before anything else, as "
        "every `AllReduceHook` subclass does."
    )
