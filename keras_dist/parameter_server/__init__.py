"""Parameter-server training: the tasks that serve a `ParameterServerStrategy`.

`keras_dist.parameter_server.serving` runs a `worker` or `ps` task's server,
for `keras_dist.auto_strategy()` and for the parameter-server tasks of
`keras-dist launch --ps M`. This file imports nothing, so that a launcher's
ps task, which imports `serving`, pays for TensorFlow only, never for Keras.
"""
