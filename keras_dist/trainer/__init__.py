"""The Keras 3 trainer: `DistributedModel` (`keras_dist.models` exports it).

One module per concern, each a mixin of `DistributedTrainerMixin`
(`mixin.py`): the training step and its aggregation path (`steps.py`), the
train/test functions with global logs (`functions.py`), `fit`'s plumbing
and parameter servers (`fit.py`), the user's batches copied before
TensorFlow sees them (`inputs.py`), saving (`saving.py`); the model classes
are in `models.py`.
"""
