"""The state inventory (`keras_dist.core.inventory`) and a model's inventory
(`keras_dist.state.training_state`).

Placement and rule come from real variables under a `MirroredStrategy` on
logical CPUs; `reshard` maps a saved value onto another replica count by
its rule; `training_state` lists a `DistributedModel`'s whole training state.
"""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.compression import PowerSGD, TopK
from keras_dist.core import inventory
from keras_dist.core.inventory import (
    MIRRORED,
    PER_REPLICA,
    RULES,
    StateEntry,
    StateInventory,
    reshard,
)
from keras_dist.state import training_state

AGG = tf.VariableAggregation
ON_READ = tf.VariableSynchronization.ON_READ


def per_replica_variable(aggregation, shape=(2,), dtype="float32"):
    return tf.Variable(
        tf.zeros(shape, dtype), synchronization=ON_READ, aggregation=aggregation
    )


# --- Placement and rule -------------------------------------------------------


@pytest.mark.parametrize(
    "aggregation, rule",
    [
        (AGG.SUM, "sum"),
        (AGG.ONLY_FIRST_REPLICA, "first"),
        (AGG.MEAN, "mean"),
        (AGG.NONE, "exact"),
    ],
)
def test_an_on_read_variable_is_per_replica_with_its_aggregations_rule(
    mirrored, aggregation, rule
):
    with mirrored(2).scope():
        variable = per_replica_variable(aggregation, shape=(3, 2), dtype="float64")
    assert inventory.placement_of(variable) == PER_REPLICA
    assert inventory.rule_of(variable) == rule
    state = StateInventory()
    state.add("hook", variable, "v")
    (entry,) = state
    assert (entry.name, entry.group) == ("hook/v", "hook")
    assert (entry.placement, entry.rule) == (PER_REPLICA, rule)
    assert entry.per_replica
    assert entry.variable is variable
    assert entry.shape == (3, 2)
    assert entry.dtype == tf.float64


@pytest.mark.parametrize(
    "aggregation", [AGG.NONE, AGG.SUM, AGG.MEAN, AGG.ONLY_FIRST_REPLICA]
)
def test_a_mirrored_variable_is_the_same_on_every_replica_count(mirrored, aggregation):
    # Whatever its aggregation: it is one value that every replica sees.
    with mirrored(2).scope():
        variable = tf.Variable(tf.zeros((4,)), aggregation=aggregation)
    assert isinstance(variable, tf.distribute.DistributedValues)
    assert inventory.placement_of(variable) == MIRRORED
    assert inventory.rule_of(variable) == "same"
    state = StateInventory()
    state.add("model", variable, "kernel")
    (entry,) = state
    assert (entry.placement, entry.rule, entry.per_replica) == (
        MIRRORED,
        "same",
        False,
    )


def test_a_variable_outside_any_strategy_is_mirrored():
    variable = tf.Variable(tf.zeros((2, 3), "float16"))
    assert inventory.placement_of(variable) == MIRRORED
    assert inventory.rule_of(variable) == "same"
    state = StateInventory()
    state.add("optimizer", variable, "slot")
    assert state.entries[0].shape == (2, 3)
    assert state.entries[0].dtype == tf.float16


def test_a_rule_given_for_a_per_replica_variable_replaces_the_derived_one(mirrored):
    with mirrored(2).scope():
        variable = per_replica_variable(AGG.SUM)
    state = StateInventory()
    state.add("hook", variable, "q", rule="first")
    assert state.entries[0].rule == "first"


# --- Refused rules ------------------------------------------------------------


@pytest.mark.parametrize("rule", ["bogus", "SUM", "", "same"])
def test_a_bad_rule_for_a_per_replica_variable_is_refused(mirrored, rule):
    with mirrored(2).scope():
        variable = per_replica_variable(AGG.SUM)
    state = StateInventory()
    with pytest.raises(
        ValueError,
        match=rf"`rule` must be one of .*'same' exactly for mirrored state and "
        rf"'owned' exactly for owned state\. Received: rule='{rule}' for the "
        rf"per_replica variable hook/v\.",
    ):
        state.add("hook", variable, "v", rule=rule)
    assert len(state) == 0
    # Refused, not remembered: the variable can still be added.
    state.add("hook", variable, "v")
    assert [entry.rule for entry in state] == ["sum"]


@pytest.mark.parametrize("rule", ["sum", "first", "mean", "exact", "bogus"])
def test_a_per_replica_rule_for_a_mirrored_variable_is_refused(mirrored, rule):
    with mirrored(2).scope():
        variable = tf.Variable(1.0)
    with pytest.raises(
        ValueError,
        match=rf"Received: rule='{rule}' for the mirrored variable model/w\.",
    ):
        StateInventory().add("model", variable, "w", rule=rule)


def test_rules_are_the_documented_seven():
    assert RULES == ("same", "sum", "first", "mean", "shard", "exact", "owned")


# --- Order, de-duplication, groups, providers ---------------------------------


def test_entries_keep_the_order_they_were_added_in(mirrored):
    with mirrored(2).scope():
        weight = tf.Variable(tf.zeros((2,)))
        slot = tf.Variable(tf.zeros((2,)))
        residual = per_replica_variable(AGG.SUM)
        total = per_replica_variable(AGG.SUM, shape=())
    state = StateInventory()
    state.add("model", weight, "dense/kernel")
    state.add("hook", residual, "residual_0")
    state.add("optimizer", slot, "sgd/momentum")
    state.add("metrics", total, "loss/total")
    names = ["model/dense/kernel", "hook/residual_0", "optimizer/sgd/momentum"]
    names.append("metrics/loss/total")
    assert [entry.name for entry in state] == names
    assert [entry.name for entry in state.entries] == names
    assert isinstance(state.entries, tuple)
    assert len(state) == 4
    assert [entry.variable for entry in state] == [weight, residual, slot, total]


def test_a_variable_added_twice_is_kept_once_under_its_first_name(mirrored):
    # An optimizer and its wrapper both list the inner optimizer's slots.
    with mirrored(2).scope():
        slot = tf.Variable(tf.zeros((2,)))
        other = tf.Variable(tf.zeros((2,)))
    state = StateInventory()
    state.add("optimizer", slot, "wrapper/inner/momentum")
    state.add("optimizer", other, "wrapper/iteration")
    state.add("optimizer", slot, "inner/momentum")
    state.add("model", slot, "again")
    assert [entry.name for entry in state] == [
        "optimizer/wrapper/inner/momentum",
        "optimizer/wrapper/iteration",
    ]
    # A second add is ignored before its rule is looked at.
    state.add("optimizer", slot, "momentum", rule="bogus")
    assert len(state) == 2


def test_two_variables_with_the_same_name_are_both_kept():
    first, second = tf.Variable(0.0, name="v"), tf.Variable(1.0, name="v")
    state = StateInventory()
    state.add("model", first, "v")
    state.add("model", second, "v")
    assert [entry.variable for entry in state] == [first, second]


def test_group_lists_one_groups_entries_in_order(mirrored):
    with mirrored(2).scope():
        variables = [tf.Variable(float(i)) for i in range(3)]
        residual = per_replica_variable(AGG.SUM)
    state = StateInventory()
    state.add("model", variables[0], "a")
    state.add("hook", residual, "residual_0")
    state.add("model", variables[1], "b")
    state.add("optimizer", variables[2], "c")
    assert [entry.name for entry in state.group("model")] == ["model/a", "model/b"]
    assert [entry.variable for entry in state.group("hook")] == [residual]
    assert state.group("metrics") == []


class Provider:
    def __init__(self, value):
        self.value = value

    def backup_state(self):
        return {"value": self.value}


def test_providers_are_held_weakly():
    state = StateInventory()
    kept, dropped = Provider(1), Provider(2)
    state.add_provider("kept", kept)
    state.add_provider("dropped", dropped)
    assert state.providers == {"kept": kept, "dropped": dropped}
    assert state.provider_states() == {"kept": {"value": 1}, "dropped": {"value": 2}}
    del dropped
    gc.collect()
    assert state.providers == {"kept": kept}
    assert state.provider_states() == {"kept": {"value": 1}}
    # Providers are not entries.
    assert len(state) == 0 and state.entries == ()


def test_a_provider_added_again_under_its_name_replaces_the_first():
    state = StateInventory()
    first, second = Provider("a"), Provider("b")
    state.add_provider("autoscale", first)
    state.add_provider("autoscale", second)
    assert state.provider_states() == {"autoscale": {"value": "b"}}


# --- reshard ------------------------------------------------------------------


def entry(rule, per_replica=True):
    placement = PER_REPLICA if per_replica else MIRRORED
    return StateEntry(f"hook/{rule}", "hook", None, placement, rule)


def saved(replicas, shape=(3,), dtype="float32", seed=0):
    """A per-replica stack `[replicas, *shape]` as a backup holds it."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(replicas, *shape)).astype(dtype)


COUNTS = [(2, 1), (2, 3), (4, 2)]


@pytest.mark.parametrize("before, after", COUNTS)
def test_mirrored_state_is_restored_as_it_is(before, after):
    value = saved(before)  # any array: a mirrored value is not a stack
    assert reshard(entry("same", per_replica=False), value, after) is value


@pytest.mark.parametrize("rule", ["sum", "first", "mean", "exact"])
def test_per_replica_state_on_the_same_count_is_restored_as_it_is(rule):
    value = saved(3)
    assert reshard(entry(rule), value, 3) is value


@pytest.mark.parametrize("before, after", COUNTS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_sum_splits_the_total_in_equal_shares(before, after, dtype):
    value = saved(before, shape=(2, 3), dtype=dtype)
    got = reshard(entry("sum"), value, after)
    assert got.shape == (after, 2, 3)
    assert got.dtype == value.dtype
    for share in got[1:]:
        np.testing.assert_array_equal(share, got[0])
    tolerance = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(
        got.astype("float64").sum(axis=0),
        value.astype("float64").sum(axis=0),
        rtol=tolerance,
        atol=tolerance,
    )


def integer_counts(before, dtype):
    """Per-replica integer sums, negative entries included."""
    row = np.array([7, -5, 0, 3, 1], dtype)
    return np.stack([row + i for i in range(before)]).astype(dtype)


@pytest.mark.parametrize("before, after", [*COUNTS, (3, 2), (1, 4)])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_sums_split_into_whole_shares_that_add_up(before, after, dtype):
    # Counts (examples accumulated, step counters): the shares are whole
    # numbers, differ by at most one and add up to the total exactly,
    # negative totals included.
    value = integer_counts(before, dtype)
    got = reshard(entry("sum"), value, after)
    assert got.shape == (after, 5)
    assert np.issubdtype(got.dtype, np.integer)
    np.testing.assert_array_equal(got.sum(axis=0), value.sum(axis=0))
    assert np.all(got.max(axis=0) - got.min(axis=0) <= 1)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("before, after", COUNTS)
def test_an_integer_sum_keeps_the_saved_dtype(before, after, dtype):
    got = reshard(entry("sum"), integer_counts(before, dtype), after)
    assert got.dtype == np.dtype(dtype)


def test_an_integer_scalar_sum_keeps_its_total():
    # 7 examples saved on 2 replicas, restored on 3: 3 + 2 + 2.
    got = reshard(entry("sum"), np.array([4, 3], "int64"), 3)
    np.testing.assert_array_equal(got, [3, 2, 2])


@pytest.mark.parametrize("before, after", COUNTS)
def test_first_gives_every_replica_replica_zeros_value(before, after):
    value = saved(before, shape=(4, 2))
    got = reshard(entry("first"), value, after)
    assert got.shape == (after, 4, 2)
    for share in got:
        np.testing.assert_array_equal(share, value[0])


@pytest.mark.parametrize("before, after", COUNTS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mean_gives_every_replica_the_mean(before, after, dtype):
    value = saved(before, shape=(3,), dtype=dtype)
    got = reshard(entry("mean"), value, after)
    assert got.shape == (after, 3)
    assert got.dtype == value.dtype
    for share in got:
        np.testing.assert_allclose(share, value.mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("before, after", COUNTS)
def test_exact_state_is_refused_on_another_count(before, after):
    with pytest.raises(
        ValueError,
        match=rf"hook/exact was saved on {before} replicas and has no rule for "
        rf"{after}: restore it on {before} replicas\.",
    ):
        reshard(entry("exact"), saved(before), after)


@pytest.mark.parametrize("before, after", [(2, 3), (4, 2)])
def test_a_resharded_sum_reads_back_as_the_same_total(mirrored, before, after):
    # Through real SUM variables: what the saving run reads in cross-replica
    # context equals what the restored run reads.
    values = saved(before, shape=(2, 2), seed=3)
    strategy = mirrored(before)
    with strategy.scope():
        source = per_replica_variable(AGG.SUM, shape=(2, 2))
    for local, value in zip(strategy.experimental_local_results(source), values):
        local.assign(value)
    state = StateInventory()
    state.add("optimizer", source, "accumulator_0")
    stack = np.stack([v.numpy() for v in strategy.experimental_local_results(source)])
    shares = reshard(state.entries[0], stack, after)

    target_strategy = mirrored(after)
    with target_strategy.scope():
        target = per_replica_variable(AGG.SUM, shape=(2, 2))
    for local, share in zip(target_strategy.experimental_local_results(target), shares):
        local.assign(share)
    np.testing.assert_allclose(target.read_value(), source.read_value(), rtol=1e-6)


# --- A DistributedModel's training state --------------------------------------


def trained_model(strategy, hook):
    """A DistributedModel with gradient accumulation and `hook`, fit 1 epoch."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3, name="hidden")(inputs)
        model = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(2, name="out")(hidden), all_reduce_hook=hook
        )
        model.compile(
            keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.Adam(0.01), accumulation_steps=2
            ),
            "mse",
            metrics=["mae"],
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.fixture(scope="module")
def topk_model(mirrored):
    return trained_model(mirrored(2), TopK(ratio=0.5))


def test_training_state_has_every_group_in_order(topk_model):
    state = training_state(topk_model)
    groups = [entry.group for entry in state]
    # Groups follow one another: model, optimizer, hook, metrics.
    order = list(dict.fromkeys(groups))
    assert order == ["model", "optimizer", "hook", "metrics"]
    assert groups == sorted(groups, key=order.index)
    assert len({id(entry.variable) for entry in state}) == len(state)
    # The model's method returns the same inventory.
    assert [e.name for e in topk_model.training_state()] == [e.name for e in state]
    assert [e.variable for e in topk_model.training_state()] == [
        e.variable for e in state
    ]


def test_model_variables_are_mirrored(topk_model):
    model_entries = training_state(topk_model).group("model")
    assert [entry.variable for entry in model_entries] == [
        v.value for v in topk_model.variables
    ]
    assert {entry.name for entry in model_entries} == {
        "model/hidden/kernel",
        "model/hidden/bias",
        "model/out/kernel",
        "model/out/bias",
    }
    for entry in model_entries:
        assert (entry.placement, entry.rule) == (MIRRORED, "same")


def test_hook_state_is_per_replica_and_summed(topk_model):
    hook = topk_model.all_reduce_hook
    entries = training_state(topk_model).group("hook")
    # Listed once, though the model and the accumulation optimizer both
    # know the hook.
    assert [entry.name for entry in entries] == [
        f"hook/{name}" for name in hook.state_names
    ]
    assert [entry.name for entry in entries] == [f"hook/residual_{i}" for i in range(4)]
    assert [entry.variable for entry in entries] == list(hook.state_variables)
    for entry in entries:
        assert (entry.placement, entry.rule) == (PER_REPLICA, "sum")
        assert len(entry.variable.values) == 2  # one value per replica


def test_accumulators_are_summed_and_optimizer_slots_the_same(topk_model):
    entries = training_state(topk_model).group("optimizer")
    optimizer = topk_model.optimizer
    assert isinstance(optimizer, keras_dist.GradientAccumulationOptimizer)
    by_name = {entry.name.rsplit("/", 1)[-1]: entry for entry in entries}
    accumulators = [f"accumulator_{i}" for i in range(4)]
    for name in [*accumulators, "accumulated_examples"]:
        assert (by_name[name].placement, by_name[name].rule) == (PER_REPLICA, "sum")
    # Counters, the inner optimizer's iterations and its Adam slots: one
    # value on every replica count.
    per_replica = {e.name for e in entries if e.per_replica}
    assert {name.rsplit("/", 1)[-1] for name in per_replica} == {
        *accumulators,
        "accumulated_examples",
    }
    slots = [e for e in entries if e.name.endswith(("_momentum", "_velocity"))]
    assert len(slots) == 8  # 2 per variable, 4 variables
    for entry in entries:
        if not entry.per_replica:
            assert entry.rule == "same"
    for name in ["accumulation_steps", "pending_micro_steps", "micro_steps"]:
        assert by_name[name].rule == "same"
    # Every variable the optimizer lists, once (the wrapper lists the inner
    # optimizer's too).
    assert [e.variable for e in entries] == [
        v.value if isinstance(v, keras.Variable) else v for v in optimizer.variables
    ]


def test_metric_sums_are_summed_over_replicas(topk_model):
    entries = training_state(topk_model).group("metrics")
    assert entries
    for entry in entries:
        assert (entry.placement, entry.rule) == (PER_REPLICA, "sum")


def test_a_registered_callback_state_is_a_provider(topk_model):
    from keras_dist.state import register_backup_state

    provider = Provider(5)
    register_backup_state(topk_model, "test_provider", provider)
    try:
        state = training_state(topk_model)
        assert state.providers["test_provider"] is provider
        assert state.provider_states()["test_provider"] == {"value": 5}
    finally:
        del provider
        gc.collect()
    assert "test_provider" not in training_state(topk_model).providers


def test_powersgd_factors_are_the_first_replicas_and_its_error_summed(mirrored):
    hook = PowerSGD(rank=1, start_step=0, min_compression_rate=1)
    model = trained_model(mirrored(2), hook)
    rules = {entry.name: entry.rule for entry in training_state(model).group("hook")}
    assert model.all_reduce_hook is hook
    assert list(rules) == [f"hook/{name}" for name in hook.state_names]
    for name, rule in rules.items():
        expected = "sum" if name.startswith("hook/error_") else "first"
        assert rule == expected, name
    assert "hook/step" in rules and any(n.startswith("hook/q_") for n in rules)


# --- the "shard" rule: slices of one vector, laid out by segments -------------


def shard_entry(segments):
    return StateEntry(
        "optimizer/slice",
        "optimizer",
        None,
        PER_REPLICA,
        "shard",
        sum(segments),
        tuple(segments),
    )


@pytest.mark.parametrize("replicas", [1, 2, 3, 7])
def test_a_vector_is_laid_out_by_segments_and_joined_back(replicas):
    whole = np.arange(1, 18, dtype="float32")
    segments = [5, 1, 11]
    stack = inventory.shard_stack(whole, segments, replicas)
    pieces = inventory.shard_pieces(segments, replicas)
    assert stack.shape == (replicas, sum(pieces))
    np.testing.assert_array_equal(inventory.join_shards(stack, segments), whole)
    # Replica r's slice is its piece of each segment, in order.
    column = start = 0
    for length, piece in zip(segments, pieces):
        padded = np.pad(whole[start : start + length], (0, piece * replicas - length))
        np.testing.assert_array_equal(
            stack[:, column : column + piece], padded.reshape(replicas, piece)
        )
        column, start = column + piece, start + length
    with pytest.raises(ValueError, match="not a layout of segments"):
        inventory.join_shards(stack[:, :-1], segments)


@pytest.mark.parametrize("before, after", [(2, 2), (2, 3), (4, 1)])
def test_slices_saved_in_one_segment_are_relaid_in_segments(before, after):
    # A backup of the single-segment layout (what every backup held before
    # segments, on any replica count) restored into a segmented one.
    whole = np.arange(1, 18, dtype="float32")
    segments = (5, 1, 11)
    saved_stack = inventory.shard_stack(whole, [17], before)
    got = reshard(shard_entry(segments), saved_stack, after, saved_segments=[17])
    np.testing.assert_array_equal(got, inventory.shard_stack(whole, segments, after))
    # The same layout on the same count is restored as it is.
    same = inventory.shard_stack(whole, segments, after)
    assert reshard(shard_entry(segments), same, after) is same
