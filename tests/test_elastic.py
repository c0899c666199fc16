"""Elastic resume on logical CPU replicas: a backup of R replicas goes on
with R' (issue 29). The multi-worker form, with `keras-dist launch
--workers MIN:MAX`, is in tests/test_elastic_workers.py.

Every run trains the same stream: global batch per update 96 (8 per
replica); `accumulation_steps` is what the script asks for on 4 replicas
(3), and the resume sets what holds 96 on the new count.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from elastic_model import (
    PER_REPLICA,
    data,
    make_model,
    seen,
)
from helpers import Boom

import keras_dist
from keras_dist import state
from keras_dist.backup import store as _backup
from keras_dist.backup.store import BackupError
from keras_dist.callbacks import AutoScaleBatch, BackupAndRestore
from keras_dist.compression import DGC, FP16, PowerSGD, TopK

EPOCHS = 3


class HookMass(keras.callbacks.Callback):
    """Records the sum over replicas of the hook's `"sum"` state at the
    first batch (after `BackupAndRestore` restored it)."""

    def __init__(self):
        super().__init__()
        self.mass = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.mass is None:
            self.mass = hook_mass(self.model)


def hook_mass(model):
    """Each `"sum"` entry of the hook, summed over the replicas."""
    strategy = model.distribute_strategy
    return [
        sum(c.numpy() for c in strategy.experimental_local_results(entry.variable))
        for entry in state.training_state(model).group("hook")
        if entry.rule == "sum"
    ]


def run(
    strategy,
    folder,
    accumulation_steps=3,
    crash_at=None,
    save_freq=3,
    hook=None,
    inputs=None,
    extra=(),
    **model_kwargs,
):
    """Trains EPOCHS epochs (or until `crash_at`); returns the model and
    the history (`None` after a crash)."""
    replicas = strategy.num_replicas_in_sync
    model = make_model(strategy, accumulation_steps, hook=hook, **model_kwargs)
    callbacks = [BackupAndRestore(folder, save_freq=save_freq), *extra]
    if crash_at:
        callbacks.append(Boom(crash_at))
    x, y = data()
    if inputs is None:
        fit_data = {"x": x, "y": y, "batch_size": PER_REPLICA * replicas}
    else:
        fit_data = inputs(x, y, replicas)
    try:
        history = model.fit(
            **fit_data, epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=0
        )
    except KeyboardInterrupt:
        return model, None
    return model, history.history


def assert_same_run(got, reference, atol=1e-5):
    model, strategy = got
    ref_model, ref_strategy = reference
    assert int(model.optimizer.iterations.numpy()) == int(
        ref_model.optimizer.iterations.numpy()
    )
    for a, b in zip(model.weights, ref_model.weights, strict=True):
        if "seen" in a.path:
            continue
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=atol)
    # Every example trained on exactly as often as in the reference.
    np.testing.assert_allclose(
        seen(model, strategy), seen(ref_model, ref_strategy), rtol=0, atol=1e-5
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on 4 replicas (accumulation 3)."""
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(4)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    model, _ = run(strategy, str(tmp_path_factory.mktemp("reference") / "b"))
    return model, strategy


STREAM = {
    "arrays": None,
    # One seeded stream over every epoch, reshuffled by `repeat`; batched
    # last, so that the sample order does not depend on the batch.
    "stream": lambda x, y, replicas: {
        "x": tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=3, reshuffle_each_iteration=True)
        .repeat()
        .batch(PER_REPLICA * replicas),
        "steps_per_epoch": len(x) // (PER_REPLICA * replicas),
    },
}


@pytest.mark.parametrize(
    ("before", "after", "steps", "crash_at"),
    [(4, 3, 4, 28), (4, 2, 6, 28), (2, 4, 3, 50)],
    ids=["4to3", "4to2", "2to4"],
)
def test_resume_on_another_replica_count_is_exact(
    mirrored, tmp_path, reference, caplog, before, after, steps, crash_at
):
    # The script asks for what holds 96 on its first count; the resumed run
    # holds 96 by `accumulation_steps = 96 / (8 x after)`.
    folder = str(tmp_path / "b")
    first = 12 // before
    model, history = run(mirrored(before), folder, first, crash_at=crash_at)
    assert history is None
    _, manifest, _ = _backup.read_latest(folder)
    assert manifest["global_batch"] == PER_REPLICA * before
    strategy = mirrored(after)
    with caplog.at_level(logging.WARNING):
        model, _ = run(strategy, folder, first)
    assert model.optimizer.accumulation_steps == steps
    assert (
        f"elastic resume: 1 worker(s) / {before} replica(s) -> 1 / {after}; global "
        f"batch per step {8 * before} -> {8 * after}, per update 96 -> 96 "
        f"(accumulation_steps={steps})"
    ) in caplog.text
    assert_same_run((model, strategy), reference)


@pytest.mark.parametrize(("before", "after"), [(4, 1), (1, 4)], ids=["4to1", "1to4"])
def test_resume_to_and_from_one_device_without_a_strategy(
    mirrored, tmp_path, reference, before, after
):
    # Without a strategy the accumulators and metric sums are plain
    # variables: a stack of 4 is merged onto them by its rule, and their
    # value is the one replica's of 4 (Ray Train shrinking to one worker).
    def strategy(count):
        return tf.distribute.get_strategy() if count == 1 else mirrored(count)

    folder = str(tmp_path / "b")
    # A backup at the end of an update (every 12 batches of 8 on one device).
    save_freq = 12 // before
    run(strategy(before), folder, 12 // before, 28 * 4 // before, save_freq)
    model, _ = run(strategy(after), folder, 12 // before, save_freq=save_freq)
    assert model.optimizer.accumulation_steps == 12 // after
    assert_same_run((model, strategy(after)), reference)


def test_a_seeded_stream_resumes_on_another_count_exactly(mirrored, tmp_path):
    # The stream reshuffles every epoch; 4 replicas, crash in epoch 2, go on
    # with 2: the same samples in the same order, in batches of 16.
    def reference():
        strategy = mirrored(4)
        return run(strategy, str(tmp_path / "r"), inputs=STREAM["stream"])[0], strategy

    expected = reference()
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, inputs=STREAM["stream"], crash_at=25)
    strategy = mirrored(2)
    model, _ = run(strategy, folder, inputs=STREAM["stream"])
    assert model.optimizer.accumulation_steps == 6
    assert_same_run((model, strategy), expected)


class Batches(keras.utils.PyDataset):
    """Batches of 32 in order: the global batch whatever the replica count."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 32

    def __getitem__(self, index):
        part = slice(32 * index, 32 * (index + 1))
        return self.x[part], self.y[part]


def test_a_py_dataset_resumes_on_another_count_exactly(mirrored, tmp_path, reference):
    # A PyDataset's batch is its own (32): on 2 replicas each takes 16, the
    # update batch 96 is held with accumulation 3 unchanged. This test found
    # TensorFlow writing into a PyDataset's arrays (keras_dist/trainer/inputs.py).
    def inputs(x, y, replicas):
        return {"x": Batches(x, y)}

    folder = str(tmp_path / "b")
    run(mirrored(4), folder, inputs=inputs, crash_at=28)
    strategy = mirrored(2)
    model, _ = run(strategy, folder, inputs=inputs)
    assert model.optimizer.accumulation_steps == 3
    assert_same_run((model, strategy), reference)


def test_a_backup_in_the_middle_of_an_update_carries_its_samples(
    mirrored, tmp_path, reference
):
    # save_freq=2 on 4 replicas: the backup after batch 26 holds 2 of 3
    # micro-steps (64 samples); on 2 replicas that is 4 of 6 micro-steps.
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, crash_at=27, save_freq=2)
    _, manifest, _ = _backup.read_latest(folder)
    assert manifest["accumulation"]["pending"] == 2
    strategy = mirrored(2)
    model, _ = run(strategy, folder, save_freq=2)
    assert_same_run((model, strategy), reference)


def test_sharded_optimizer_state_is_resharded_exactly(mirrored, tmp_path, reference):
    # ZeRO stage 1 under accumulation: each replica's slice of the momentum
    # is joined and split again for 2 replicas.
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, crash_at=28, sharded=True)
    _, manifest, _ = _backup.read_latest(folder)
    assert any(entry["rule"] == "shard" for entry in manifest["variables"])
    strategy = mirrored(2)
    model, _ = run(strategy, folder, sharded=True)
    assert_same_run((model, strategy), reference)


def test_an_optimizer_that_accumulates_on_its_own_is_refused(mirrored, tmp_path):
    # ShardedOptimizer(accumulation_steps=3) makes the update batch 3x the
    # step batch where the resume cannot see or change it.
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, 1, crash_at=28, sharded=True, sharded_steps=3)
    with pytest.raises(ValueError, match=r"ShardedOptimizer\(accumulation_steps=3\)"):
        run(mirrored(2), folder, 1, sharded=True, sharded_steps=3)


def test_a_position_that_is_not_whole_batches_is_refused(mirrored, tmp_path):
    # The same backup (64 pending samples) on 3 replicas: batches of 24.
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, crash_at=27, save_freq=2)
    with pytest.raises(
        BackupError,
        match=r"2 micro-step\(s\) of 32 samples accumulated: 64 samples, not a "
        r"whole number of this run's batches of 24\. Resuming there would skip",
    ):
        run(mirrored(3), folder)


# hook -> (factory, model arguments, bound on the final loss, relative).
# Measured 4 -> 2: FP16 1.4e-5, TopK(0.25) 2.0e-2, PowerSGD(rank=1) 1.6e-7,
# DGC(0.25) 1.3e-2 (sparsification differs with the replica count).
COMPRESSED = {
    "fp16": (FP16, {}, 1e-3),
    "topk": (lambda: TopK(0.25), {}, 0.05),
    "powersgd": (lambda: PowerSGD(rank=1, start_step=0), {}, 1e-3),
    "dgc": (lambda: DGC(0.25, warmup_steps=0), {"momentum": 0.0}, 0.05),
}


@pytest.mark.parametrize(
    "hook",
    [
        pytest.param(hook, marks=[pytest.mark.extended] if hook != "powersgd" else [])
        for hook in sorted(COMPRESSED)
    ],
)
def test_compressed_training_resumes_on_fewer_replicas(
    mirrored, tmp_path, reference, hook
):
    # Not exact (the compression rounds or sparsifies per replica, and the
    # replicas change), but the same run: the final loss close to the
    # uninterrupted one on 4 replicas; the hook's per-replica sums (TopK's
    # and PowerSGD's error feedback, DGC's velocities) keep their total over
    # the replicas (the "sum" rule), PowerSGD's factors are copied.
    make_hook, kwargs, bound = COMPRESSED[hook]
    strategy = mirrored(4)
    expected, expected_history = run(
        strategy, str(tmp_path / "r"), hook=make_hook(), **kwargs
    )
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, hook=make_hook(), crash_at=28, **kwargs)
    _, manifest, values = _backup.read_latest(folder)
    saved_mass = [
        value.sum(axis=0)
        for entry, value in zip(manifest["variables"], values)
        if entry["name"].startswith("hook/") and entry["rule"] == "sum"
    ]
    assert bool(saved_mass) == (hook != "fp16")
    mass = HookMass()
    strategy = mirrored(2)
    model, history = run(strategy, folder, hook=make_hook(), extra=[mass], **kwargs)
    assert len(mass.mass) == len(saved_mass)
    for got, saved in zip(mass.mass, saved_mass):
        assert np.abs(saved).sum() > 0
        np.testing.assert_allclose(got, saved, rtol=1e-6, atol=1e-7)
    assert int(model.optimizer.iterations.numpy()) == int(
        expected.optimizer.iterations.numpy()
    )
    assert history["loss"][-1] == pytest.approx(expected_history["loss"][-1], rel=bound)
    np.testing.assert_allclose(seen(model, strategy), 3.0, atol=1e-5)


def test_the_learning_rate_follows_the_update_batch_when_it_cannot_be_held(
    mirrored, tmp_path, caplog
):
    # accumulation_steps=1 on 4 replicas: 32 per update; on 3 replicas an
    # update holds 24 (32 is no multiple of 24): linear rule, x0.75.
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, accumulation_steps=1, crash_at=28)
    with caplog.at_level(logging.WARNING):
        model, _ = run(mirrored(3), folder, accumulation_steps=1)
    assert model.optimizer.learning_rate.numpy() == pytest.approx(0.05 * 0.75)
    assert (
        "the update batch cannot be held (32 is not a multiple of this run's step "
        "batch 24): learning rate 0.05 -> 0.0375 (linear rule, x0.75)"
    ) in caplog.text


def test_a_schedule_that_must_follow_the_batch_is_refused(mirrored, tmp_path):
    folder = str(tmp_path / "b")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.9)
    run(mirrored(4), folder, accumulation_steps=1, crash_at=28, lr=schedule)
    with pytest.raises(BackupError, match=r"must follow it, but it is a schedule"):
        run(mirrored(3), folder, accumulation_steps=1, lr=schedule)


@pytest.mark.parametrize(
    ("steps", "new_rate"), [(3, 0.05), (1, 0.05 * 0.75)], ids=["held", "rescaled"]
)
def test_autoscale_batch_follows_the_resize(
    mirrored, tmp_path, caplog, steps, new_rate
):
    # AutoScaleBatch batches the arrays itself at 8 x replicas. Held: 96 per
    # update on 4 and on 3 replicas, the rate unchanged. Not held
    # (accumulation 1): 32 -> 24 per update, and its linear rule sets 0.75x.
    def autoscale():
        return AutoScaleBatch(PER_REPLICA, base_batch_size=32 * steps)

    def inputs(x, y, replicas):
        return {"x": x, "y": y}

    folder = str(tmp_path / "b")
    run(
        mirrored(4),
        folder,
        steps,
        crash_at=27,
        inputs=inputs,
        extra=[autoscale()],
    )
    callback = autoscale()
    with caplog.at_level(logging.WARNING):
        model, history = run(
            mirrored(3), folder, steps, inputs=inputs, extra=[callback]
        )
    assert callback.batch_size == 24 * model.optimizer.accumulation_steps
    assert history["learning_rate"][-1] == pytest.approx(new_rate, rel=1e-6)
    if steps == 1:
        assert (
            "AutoScaleBatch's rule (lr_scaling='linear') sets the learning rate "
            "for 24" in caplog.text
        )
    np.testing.assert_allclose(seen(model, model.distribute_strategy), 3.0, atol=1e-5)


def test_a_plain_keras_model_cannot_resume_on_another_count(mirrored, tmp_path):
    folder = str(tmp_path / "b")
    run(mirrored(4), folder, crash_at=28)
    strategy = mirrored(2)
    model = make_model(strategy, 3)
    plain = model.layers[0] if isinstance(model, keras_dist.DistributedModel) else model
    with strategy.scope():
        plain.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.05), accumulation_steps=3
            ),
            loss="mse",
        )
    x, y = data()
    with pytest.raises(BackupError, match=r"keras_dist cannot tell for a plain"):
        plain.fit(
            x,
            y,
            batch_size=16,
            epochs=EPOCHS,
            shuffle=False,
            callbacks=[BackupAndRestore(folder, save_freq=3)],
            verbose=0,
        )
