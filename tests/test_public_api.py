"""`import keras_dist` gives every documented name, and checks the versions.

The documentation calls `keras_dist.strategy.describe_choice()`,
`keras_dist.memory.memory_growth_state()` and the like after a plain
`import keras_dist`; those submodules load on first access. The version
policy (tested / accepted / refused) is `keras_dist/_versions.py`.
"""

import warnings

import pytest
from helpers import run_python

import keras_dist
from keras_dist import _versions

SUBMODULES = (
    "batch_size",
    "callbacks",
    "cluster",
    "compression",
    "memory",
    "models",
    "noise_scale",
    "optimizers",
    "strategy",
    "testing",
    "tf_keras",
)


def test_every_public_name_resolves():
    for name in keras_dist.__all__:
        assert getattr(keras_dist, name) is not None, name
    assert set(SUBMODULES) <= set(keras_dist.__all__)
    assert set(SUBMODULES) <= set(dir(keras_dist))


def test_documented_submodule_calls_work_after_a_plain_import():
    # A fresh interpreter: this session has imported every submodule already.
    result = run_python(
        """
        import keras_dist

        choice = keras_dist.strategy.describe_choice({}, num_gpus=0)
        assert choice.name == "DefaultStrategy", choice
        assert keras_dist.memory.memory_growth_state() == {}
        assert callable(keras_dist.testing.run_workers)
        assert callable(keras_dist.batch_size.find_max_batch_size)
        assert callable(keras_dist.noise_scale.estimate_noise)
        assert keras_dist.cluster.make_tf_config
        assert keras_dist.callbacks.AutoScaleBatch
        print("ok")
        """
    )
    assert result.stdout.strip().endswith("ok"), result.stdout


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        keras_dist.no_such_thing  # noqa: B018


# --- Versions: tested, accepted, refused --------------------------------------


def test_the_installed_versions_are_tested_and_import_silently():
    result = run_python(
        """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import keras_dist
        texts = [str(w.message) for w in caught]
        assert not [t for t in texts if "keras_dist is tested with" in t], texts
        print("ok")
        """
    )
    assert result.stdout.strip().endswith("ok"), result.stdout


@pytest.mark.parametrize(
    "keras_version, tensorflow_version",
    [("3.15.1", "2.21.0"), ("3.15.0", "2.21.3")],
)
def test_tested_versions_pass_silently(keras_version, tensorflow_version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_versions(keras_version, tensorflow_version)


@pytest.mark.parametrize(
    "keras_version, tensorflow_version, named",
    [
        ("3.16.0", "2.21.0", "Keras 3.16.0"),
        ("3.5.0", "2.21.0", "Keras 3.5.0"),
        ("3.15.1", "2.22.0rc1", "TensorFlow 2.22.0rc1"),
        ("3.15.1", "2.16.1", "TensorFlow 2.16.1"),
    ],
)
def test_untested_versions_warn_naming_the_tested_range(
    keras_version, tensorflow_version, named
):
    with pytest.warns(_versions.UntestedVersionWarning) as record:
        _versions.check_versions(keras_version, tensorflow_version)
    (warning,) = record
    message = str(warning.message)
    assert named in message
    assert "keras_dist is tested with" in message
    tested = _versions.TESTED_KERAS if "Keras" in named else _versions.TESTED_TENSORFLOW
    assert tested[0] in message


@pytest.mark.parametrize(
    "keras_version, tensorflow_version, match",
    [
        ("2.15.0", "2.21.0", r"needs Keras >= 3\.5\. Received: Keras 2\.15\.0"),
        ("3.4.1", "2.21.0", r"needs Keras >= 3\.5\. Received: Keras 3\.4\.1"),
        ("3.15.1", "2.15.0", r"needs TensorFlow >= 2\.16\. Received: TensorFlow"),
    ],
)
def test_versions_below_the_minimum_are_refused(
    keras_version, tensorflow_version, match
):
    with pytest.raises(ImportError, match=match):
        _versions.check_versions(keras_version, tensorflow_version)


def test_the_minimums_match_setup_cfg():
    from helpers import REPO_ROOT

    setup = (REPO_ROOT / "setup.cfg").read_text(encoding="utf-8")
    assert f"keras>={_versions.MINIMUM_KERAS}" in setup
    assert f"tensorflow>={_versions.MINIMUM_TENSORFLOW}" in setup
