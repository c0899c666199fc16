# The vendored tf-keras tests run only through run.py (imports rewritten,
# optimizers substituted), never collected as they are.
collect_ignore = ["tf_keras_v2_21_0"]
