"""Tests that a wrapper legitimately cannot pass, each with its reason.

A test belongs here only when it checks what a wrapper cannot be: the
wrapped class's identity or own API, a private attribute of the wrapped
object, a mock patched onto the outer object, or what the wrapper refuses by
design. Anything else that passes stock must pass with keras_dist
substituted (a keras_dist bug goes to known_defects.py instead). `checks.py`
marks these `xfail(strict=True)`, so an entry that starts passing fails the
suite and must be removed.
"""

from __future__ import annotations

_GROUPS = [
    (
        (
            "Reads `_model_variables_moving_average`, a private attribute of the "
            "wrapped optimizer's EMA, on the wrapper. (Keras's `SwapEMAWeights` "
            "reaches it through `inner_optimizer` and works.)"
        ),
        {
            "optimizers": [
                "adam_test.py::AdamTest::test_ema",
                "adam_test.py::AdamTest::test_ema_overwrite_frequency",
                "multi_optimizer_test.py::MultiOptimizerTest::test_swap_ema_weights_with_multi_optimizer",
                "optimizer_test.py::OptimizerTest::test_ema",
                "optimizer_test.py::OptimizerTest::test_ema_with_model_fit",
            ],
        },
    ),
    (
        (
            "Reads a private attribute of the wrapped optimizer on the wrapper "
            "(`Muon._should_use_adamw`, `Muon._apply_weight_decay`, "
            "`Nadam._u_product`)."
        ),
        {
            "optimizers": [
                "muon_test.py::MuonTest::test_adamw_weight_decay",
                "muon_test.py::MuonTest::test_muon_weight_decay",
                "muon_test.py::MuonTest::test_should_use_adamw",
                "nadam_test.py::NadamTest::test_build_with_empty_var_list",
            ],
        },
    ),
    (
        (
            "Calls the wrapped class's own method on the wrapper "
            "(`Muon.zeropower_via_newtonschulz5`, `Muon.lr_adjust`, or "
            "`update_step`, the per-variable step that a wrapper does not have); "
            "it is on `inner_optimizer`, as with LossScaleOptimizer."
        ),
        {
            "optimizers": [
                "muon_test.py::MuonTest::test_Newton_Schulz",
                "muon_test.py::MuonTest::test_adamw_single_step",
                "muon_test.py::MuonTest::test_lr_adjust_2d",
                "muon_test.py::MuonTest::test_lr_adjust_none",
                "muon_test.py::MuonTest::test_muon_single_step",
            ],
        },
    ),
    (
        (
            "Reads `initial_scale`, LossScaleOptimizer's own attribute, on "
            "`GradientAccumulationOptimizer(LossScaleOptimizer(...))`, the "
            "wrapper outside."
        ),
        {
            "optimizers": [
                "loss_scale_optimizer_test.py[outside]::LossScaleOptimizerTest::test_apply_with_no_vars",
                "loss_scale_optimizer_test.py[outside]::LossScaleOptimizerTest::test_finite_step_stateful",
                "loss_scale_optimizer_test.py[outside]::LossScaleOptimizerTest::test_finite_step_with_inner_loss_scale_stateful",
            ],
        },
    ),
    (
        (
            "Asserts LossScaleOptimizer's config keys on "
            "`GradientAccumulationOptimizer(LossScaleOptimizer(...))`, the "
            "wrapper outside (its config nests LossScaleOptimizer's)."
        ),
        {
            "optimizers": [
                "loss_scale_optimizer_test.py[outside]::LossScaleOptimizerTest::test_serialization",
            ],
        },
    ),
    (
        (
            "Patches `assign`, `assign_add`, `assign_sub` and "
            "`_apply_weight_decay` onto the optimizer object it holds (for a "
            "LossScaleOptimizer, onto `inner_optimizer`): patched on the wrapper, "
            "the inner optimizer's calls are not seen."
        ),
        {
            "optimizers": [
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adadelta",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adafactor",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adagrad",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adam",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adam_amsgrad",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adamax",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adamw",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_adamw_amsgrad",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_ftrl",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_lion",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_loss_scale_optimizer_sgd",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_nadam",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_rmsprop",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_rmsprop_momentum",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_rmsprop_momentum_centered",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_sgd",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_sgd_momentum",
                "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_sgd_momentum_nesterov",
            ],
        },
    ),
    (
        (
            "Asserts the deserialized sub-optimizers' `__class__.__name__` "
            "(`'Adam'`): class identity."
        ),
        {
            "optimizers": [
                "multi_optimizer_test.py::MultiOptimizerTest::test_serialization",
            ],
        },
    ),
    (
        (
            "Asserts an optimizer's generated `name` (`adam`, `adam_1`; the "
            "TensorBoard key `learning_rate_<name>`): the wrapper has its own "
            "name, as two optimizers cannot share variable paths."
        ),
        {
            "optimizers": [
                "multi_optimizer_test.py::MultiOptimizerTest::test_tensorboard_logging_with_multi_optimizer",
                "optimizer_test.py::OptimizerTest::test_optimizer_auto_naming",
            ],
        },
    ),
    (
        (
            "Counts or indexes `optimizer.variables`: the wrapper's own state "
            "(its counters and accumulators, as LossScaleOptimizer's scale and "
            "step counter) is part of them."
        ),
        {
            "optimizers": [
                "learning_rate_schedule_test.py::TestFitLRSchedulesFlow::test_fit_lr_correctness",
                "optimizer_test.py::OptimizerTest::test_setting_lr_to_callable_untracks_lr_var",
                "sgd_test.py::SGDTest::test_single_step",
            ],
        },
    ),
    (
        (
            "Gives the inner optimizer Keras's own `gradient_accumulation_steps`, "
            "which the wrapper refuses by design: it fails under tf.distribute "
            "(keras-team/keras#20582); `accumulation_steps` replaces it."
        ),
        {
            "optimizers": [
                "optimizer_test.py::OptimizerTest::test_gradient_accumulation",
                "optimizer_test.py::OptimizerTest::test_overwrite_with_gradient_with_gradient_accumulation",
            ],
        },
    ),
    (
        (
            "Asserts `type(optimizer) == type(loaded_model.optimizer)`: "
            "`DistributedOptimizer` returns a subclass of the optimizer's class "
            "(`isinstance` holds), and the `.h5` file loads the plain class by "
            "design."
        ),
        {
            "tf_keras-optimizers": [
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel0",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel1",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel10",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel3",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel4",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel5",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel6",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel8",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel9",
            ],
        },
    ),
    (
        (
            "Under `non_finite_gradients='skip'` (DistributedModel's default) the "
            "non-finite update is skipped, so the weights stay finite and the "
            "logged loss is `inf` where stock Keras's NaN weights make it `nan`. "
            "With `compile(..., non_finite_gradients='apply')` the test passes."
        ),
        {
            "callbacks": [
                "csv_logger_test.py::CSVLoggerTest::test_stop_training_csv",
            ],
        },
    ),
    (
        (
            "Checks `type(loaded_optimizer) == type(optimizer)`: "
            "`DistributedOptimizer` changes the class of the optimizer it wraps "
            "to a subclass (tf_keras saves it under the wrapped class's name, so "
            "the loaded optimizer is the plain class)."
        ),
        {
            "tf_keras-optimizers": [
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel2",
                "optimizer_test.py::OptimizerFuntionalityTest::testSaveAndLoadOptimizerWithModel7",
            ],
        },
    ),
    (
        (
            "Applies a gradient of shape (1,) to a variable of shape (1, 1). The "
            "all-reduce hook refuses a gradient whose shape differs from its "
            "variable's, before any collective, by design: under several replicas "
            "a mismatch would hang or corrupt the sum."
        ),
        {
            "tf_keras-optimizers": [
                "optimizer_test.py::OptimizerFuntionalityTest::testVariableConstraints",
            ],
        },
    ),
]


def _by_suite(groups) -> dict[str, dict[str, str]]:
    """{suite: {test id: reason}} from (reason, {suite: [test ids]}) groups."""
    table: dict[str, dict[str, str]] = {}
    for reason, ids_by_suite in groups:
        for suite, ids in ids_by_suite.items():
            for test_id in ids:
                if test_id in table.setdefault(suite, {}):
                    raise ValueError(f"{suite}: {test_id} is listed twice")
                table[suite][test_id] = reason
    return table


EXCEPTIONS = _by_suite(_GROUPS)
