"""`BackupAndRestore` and what it stands on (`keras_dist.callbacks` exports it).

- `callback`: the Keras callback (when to save, restore, replay, preemption).
- `resume`: what a resumed `fit` replays, and the checks before it does.
- `transfer`: a `StateInventory`'s values to NumPy and back, per replica.
- `manifest`: what a backup says about itself; compatibility checks and the
  rule for a changed `accumulation_steps`.
- `store`: the backups: atomic writes, checksums, fallback, pruning.
- `lock`: one job per `backup_dir` (the `LOCK` owner file).
- `files`: local paths through `os`, URLs (`gs://`, `ram://`) through
  `tf.io.gfile`.

The backup never imports the trainer: a model hands it its state
(`keras_dist.state.training_state`).
"""
