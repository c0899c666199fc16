"""The one inventory of training state: what a step reads or writes, and how.

A model's training state is spread over objects that do not know each
other: the layers' variables, the optimizer's slots and `iterations`, the
accumulators of gradient accumulation, the all-reduce hook's state (error
feedback, PowerSGD's factors, DGC's velocities), gradient statistics, the
metrics' running sums, and plain Python state of callbacks (AutoScaleBatch).
A `StateInventory` lists all of it once, in a fixed order, with each
variable's placement and its rule for another number of replicas. Backups
(`keras_dist.backup`) save and restore exactly what it lists; the front end
builds it (`DistributedModel.training_state()`).

Placement: a *mirrored* variable holds one value that every replica sees
(model weights, optimizer slots, counters; also a variable on a parameter
server); a *per-replica* one (`synchronization=ON_READ`) holds a value per
replica that the replica reads and writes alone. Under local SGD the
weights and slots are per replica between syncs too (mirrored variables
whose copies part), and are listed so.

Rules for restoring per-replica state on `R'` replicas when it was saved
on `R` (`reshard`):

- `"sum"` (`VariableAggregation.SUM`): the values add up to what matters
  (accumulated gradients and examples, error-feedback residuals, DGC's
  momentum, metric sums): summed, then split in equal shares, so the total
  is kept.
- `"first"` (`ONLY_FIRST_REPLICA`): every replica keeps the same value
  (PowerSGD's warm-start factors, step counters): replica 0's copy to all.
- `"mean"` (`MEAN`): averaged, the mean to every replica.
- `"shard"`: each replica holds its slice of one vector (a
  `ShardedOptimizer`'s parameters and optimizer state), laid out by
  segments (`shard_stack`): the slices are joined into the vector
  (`join_shards`) and split again for `R'`, or for another segmentation.
- `"exact"` (`NONE`): no rule; restorable only on the same replica count.

Mirrored state is restored as it is on any replica count. *Owned* state
(placement `OWNED`, rule `"owned"`) is held whole by one replica, its
owner, and by no other: the optimizer state of a variable under
`ShardedOptimizer(..., shard_by="variables")`. It is saved whole, like a
mirrored value, and restored onto whichever replica owns the variable on
the new replica count.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import tensorflow as tf

MIRRORED = "mirrored"
PER_REPLICA = "per_replica"
OWNED = "owned"

RULES = ("same", "sum", "first", "mean", "shard", "exact", "owned")
"""The resharding rules; `"same"` is the rule of every mirrored entry and
`"owned"` of every owned one."""

_RULE_OF_PLACEMENT = {MIRRORED: "same", OWNED: "owned"}

_RULE_OF_AGGREGATION = {
    tf.VariableAggregation.SUM: "sum",
    tf.VariableAggregation.ONLY_FIRST_REPLICA: "first",
    tf.VariableAggregation.MEAN: "mean",
    tf.VariableAggregation.NONE: "exact",
}


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """One variable of the training state.

    Attributes:
        name: String. Where it comes from, `"<group>/<path>"` (for example
            `"model/dense/kernel"`, `"hook/residual_0"`).
        group: String. `"model"`, `"optimizer"`, `"hook"`, `"statistics"`
            or `"metrics"`.
        variable: The TensorFlow variable (a distributed one under a
            strategy); for `OWNED` state, its handle (`shape`, `dtype`,
            `local`, `read()`, `assign(value)`; `keras_dist._owned`).
        placement: String. `MIRRORED`, `PER_REPLICA` or `OWNED`.
        rule: String, one of `RULES`: how it is restored on another
            number of replicas.
        length: Int or `None`. For the `"shard"` rule: the length of the
            vector the slices are pieces of (without padding).
        segments: Tuple of ints or `None`. For the `"shard"` rule: the
            lengths of the consecutive segments of that vector, each split
            over the replicas on its own (`shard_stack`); `None`: one
            segment, the whole vector.
    """

    name: str
    group: str
    variable: object
    placement: str
    rule: str
    length: int | None = None
    segments: tuple | None = None

    @property
    def shard_segments(self) -> tuple | None:
        """The segment lengths of a `"shard"` entry (`None` for the others)."""
        if self.length is None:
            return None
        return tuple(self.segments) if self.segments else (self.length,)

    @property
    def per_replica(self) -> bool:
        """Whether each replica holds its own value."""
        return self.placement == PER_REPLICA

    @property
    def owned(self) -> bool:
        """Whether one replica, its owner, holds the value whole."""
        return self.placement == OWNED

    @property
    def shape(self) -> tuple:
        """The variable's shape (of one replica's value)."""
        return tuple(int(d) for d in self.variable.shape)

    @property
    def dtype(self) -> tf.DType:
        """The variable's dtype."""
        return tf.as_dtype(self.variable.dtype)


def placement_of(variable) -> str:
    """`PER_REPLICA` for an `ON_READ` distributed variable, else `MIRRORED`."""
    if (
        isinstance(variable, tf.distribute.DistributedValues)
        and variable.synchronization == tf.VariableSynchronization.ON_READ
    ):
        return PER_REPLICA
    return MIRRORED


def rule_of(variable) -> str:
    """The resharding rule of `variable`, from its placement and aggregation."""
    if placement_of(variable) == MIRRORED:
        return "same"
    return _RULE_OF_AGGREGATION.get(variable.aggregation, "exact")


class StateInventory:
    """Every piece of one model's training state, in a fixed order.

    The order is the order entries were added, which for the same model,
    optimizer and hook built the same way is the same in every process: a
    backup checks it entry by entry. A variable added twice (an optimizer
    and its wrapper list the same slots) is kept once, under its first
    name.

    Besides variables it holds *providers*: objects with plain Python state
    (`backup_state() -> dict`, `restore_backup_state(dict)`), such as
    `AutoScaleBatch`, held weakly under a name.
    """

    def __init__(self):
        self._entries: list[StateEntry] = []
        self._seen: set[int] = set()
        self._providers: dict[str, weakref.ref] = {}

    def add(
        self,
        group: str,
        variable,
        name: str,
        rule: str | None = None,
        length: int | None = None,
        placement: str | None = None,
        segments: tuple | None = None,
    ) -> None:
        """Adds one TensorFlow variable under `"<group>/<name>"`.

        Args:
            group: String. The entry's group.
            variable: The TensorFlow variable (distributed or not).
            name: String. Its path within the group.
            rule: String or `None`: one of `RULES`, or `None` for the rule
                its placement and aggregation give (`rule_of`).
            length: Int or `None`. The unpadded length, for `"shard"`.
            placement: String or `None`: `PER_REPLICA` for a mirrored
                variable whose replicas hold values of their own between
                synchronizations (local SGD's weights and slots); `OWNED`
                for state one replica holds (then `variable` is its handle
                and `rule` is `"owned"`); `None` for the placement its
                synchronization gives (`placement_of`).
            segments: Tuple of ints or `None`. For `"shard"`: the lengths
                of the vector's segments (they add up to `length`); `None`
                for one segment.

        Raises:
            ValueError: `rule` is not one of `RULES`, or not the rule of
                the placement (`"same"` for mirrored, `"owned"` for owned
                state, another for per-replica state).
        """
        if id(variable) in self._seen:
            return
        placement = placement_of(variable) if placement is None else placement
        if placement not in (MIRRORED, PER_REPLICA, OWNED):
            raise ValueError(
                f"`placement` must be {MIRRORED!r}, {PER_REPLICA!r}, {OWNED!r} "
                f"or None. Received: placement={placement!r} for {group}/{name}."
            )
        expected = _RULE_OF_PLACEMENT.get(placement)  # None: per replica
        if rule is None:
            rule = expected or rule_of(variable)
        if rule not in RULES or (
            rule != expected if expected else rule in _RULE_OF_PLACEMENT.values()
        ):
            raise ValueError(
                f"`rule` must be one of {list(RULES)}, 'same' exactly for "
                "mirrored state and 'owned' exactly for owned state. Received: "
                f"rule={rule!r} for the {placement} variable {group}/{name}."
            )
        self._seen.add(id(variable))
        if (rule == "shard") != (length is not None):
            raise ValueError(
                "`length` goes with the 'shard' rule, and only with it. "
                f"Received: rule={rule!r}, length={length!r} for {group}/{name}."
            )
        if segments is not None and (
            length is None or sum(int(n) for n in segments) != length
        ):
            raise ValueError(
                "`segments` must add up to `length`. Received: "
                f"segments={segments!r}, length={length!r} for {group}/{name}."
            )
        self._entries.append(
            StateEntry(
                f"{group}/{name}",
                group,
                variable,
                placement,
                rule,
                length,
                None if segments is None else tuple(int(n) for n in segments),
            )
        )

    def add_provider(self, name: str, provider) -> None:
        """Adds an object whose `backup_state()` is saved under `name`."""
        self._providers[name] = weakref.ref(provider)

    @property
    def entries(self) -> tuple:
        """The `StateEntry`s, in order."""
        return tuple(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def group(self, name: str) -> list:
        """The entries of one group, in order."""
        return [entry for entry in self._entries if entry.group == name]

    @property
    def providers(self) -> dict:
        """Name -> provider, for the providers still alive."""
        alive = {name: ref() for name, ref in self._providers.items()}
        return {name: provider for name, provider in alive.items() if provider}

    def provider_states(self) -> dict:
        """Name -> `provider.backup_state()` of every provider."""
        return {name: p.backup_state() for name, p in self.providers.items()}


def shard_pieces(segments, replicas: int) -> list:
    """Each segment's piece per replica: `ceil(length / replicas)`, >= 1."""
    return [max(1, -(-int(n) // replicas)) for n in segments]


def shard_stack(whole, segments, replicas: int) -> np.ndarray:
    """A vector laid out as `replicas` slices, segment by segment.

    Each segment (consecutive elements of `whole`, in order) is padded to a
    multiple of `replicas` and split into equal pieces; replica `r`'s slice
    is its piece of every segment, in segment order. One segment is a plain
    split of the padded vector.

    Args:
        whole: 1-D array of `sum(segments)` elements.
        segments: Sequence of ints: the segments' lengths.
        replicas: Int. The replicas to lay it out on.

    Returns:
        Array `[replicas, sum(shard_pieces(segments, replicas))]`.
    """
    whole = np.asarray(whole).reshape(-1)
    pieces = shard_pieces(segments, replicas)
    stack = np.zeros((replicas, sum(pieces)), whole.dtype)
    start = column = 0
    for length, piece in zip(segments, pieces):
        padded = np.zeros(piece * replicas, whole.dtype)
        padded[:length] = whole[start : start + length]
        stack[:, column : column + piece] = padded.reshape(replicas, piece)
        start += length
        column += piece
    return stack


def join_shards(stack, segments) -> np.ndarray:
    """The inverse of `shard_stack`: the vector, without padding.

    Raises:
        ValueError: the stack's slices are not of the segments' layout.
    """
    stack = np.asarray(stack)
    replicas = stack.shape[0]
    stack = stack.reshape(replicas, -1)
    pieces = shard_pieces(segments, replicas)
    if stack.shape[1] != sum(pieces):
        raise ValueError(
            f"Slices of {stack.shape[1]} elements on {replicas} replica(s) are "
            f"not a layout of segments {list(segments)} (slices of "
            f"{sum(pieces)} elements). The state was saved by another model "
            "or optimizer."
        )
    parts = []
    column = 0
    for length, piece in zip(segments, pieces):
        parts.append(stack[:, column : column + piece].reshape(-1)[:length])
        column += piece
    return np.concatenate(parts) if parts else stack.reshape(-1)[:0]


def reshard(
    entry: StateEntry, value: np.ndarray, replicas: int, saved_segments=None
) -> np.ndarray:
    """Maps a saved value of `entry` onto `replicas` replicas, by its rule.

    Args:
        entry: The `StateEntry` the value belongs to.
        value: The saved value: the mirrored value, or a per-replica stack
            `[saved_replicas, ...]`.
        replicas: Int. The replicas to restore onto.
        saved_segments: Sequence of ints or `None`. For a `"shard"` entry:
            the segments the value was laid out by when saved (`None`: this
            entry's). Slices of another layout are relaid on any replica
            count.

    Returns:
        The value to restore: the mirrored value, or a `[replicas, ...]`
        stack.

    Raises:
        ValueError: the entry's rule is `"exact"` and the counts differ.
    """
    if entry.per_replica and entry.rule == "shard":
        segments = entry.shard_segments
        saved = segments if saved_segments is None else tuple(saved_segments)
        if value.shape[0] == replicas and saved == segments:
            return value
        return shard_stack(join_shards(value, saved), segments, replicas)
    if not entry.per_replica or value.shape[0] == replicas:
        return value
    if entry.rule == "sum":
        total = value.sum(axis=0)
        share = total / replicas if np.issubdtype(total.dtype, np.inexact) else None
        if share is None:
            # Integer sums (counts) split into whole shares that add up.
            base, extra = np.divmod(total, replicas)
            return np.stack(
                [base + (extra > i).astype(total.dtype) for i in range(replicas)]
            ).astype(value.dtype)
        return np.stack([share.astype(value.dtype)] * replicas)
    if entry.rule == "first":
        return np.stack([value[0]] * replicas)
    if entry.rule == "mean":
        return np.stack([value.mean(axis=0).astype(value.dtype)] * replicas)
    raise ValueError(
        f"{entry.name} was saved on {value.shape[0]} replicas and has no rule "
        f"for {replicas}: restore it on {value.shape[0]} replicas."
    )
