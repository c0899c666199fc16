"""`BackupAndRestore` and what it stands on (`keras_dist.callbacks` exports it).

- `callback`: the Keras callback (when to save, restore, replay, preemption).
- `transfer`: a `StateInventory`'s values to NumPy and back, per replica.
- `manifest`: what a backup says about itself; compatibility checks.
- `store`: the files: atomic writes, checksums, fallback, pruning.

The backup never imports the trainer: a model hands it its state
(`keras_dist.state.training_state`).
"""
