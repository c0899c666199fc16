"""Every touch of private Keras and TensorFlow API, in one package.

- `tf_internal`: private TensorFlow (no Keras import), for the core and the
  tf_keras front end.
- `keras_src`: private Keras 3 (`keras.src.*`) and what the Keras 3 front
  end needs of TensorFlow's internals.
- `parameter_servers`: the two fixes a parameter-server `fit` traces its
  steps with (atomic `assign_add`, partitioned variables' updates).

Each touch carries its reason, so an upgrade has one place to check;
`tests/test_compat.py` fails loudly when any of them moves.
"""
