"""TensorFlow profiler traces, read: the ops of the last profiled `fit` step.

`bench_overlap.py`, `bench_sharding.py` and `bench_step_trace.py` profile a
few steps of a worker with `tf.profiler.experimental.start(folder)` and
read them back here.
"""

from __future__ import annotations

import glob
import os


def last_step_ops(folder) -> tuple[float, float, list]:
    """The last `fit` step of a trace, and the host's ops started inside it.

    Args:
        folder: String. The folder given to `tf.profiler.experimental.start`.

    Returns:
        `(step_start, step_end, ops)`: the step's start and end in ms, and
        `(start, end, op_name, op_type)` of each op (ms), sorted.

    Raises:
        RuntimeError: the trace holds no train step.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as handle:
        space.ParseFromString(handle.read())
    (plane,) = [p for p in space.planes if p.name == "/host:CPU"]
    events, steps = [], []
    for line in plane.lines:
        for event in line.events:
            name = plane.event_metadata[event.metadata_id].name
            start = (line.timestamp_ns * 1000 + event.offset_ps) / 1e9  # ms
            end = start + event.duration_ps / 1e9
            if name.startswith("EagerLocalExecute: __inference_") and (
                "step_on_iterator" in name
            ):
                steps.append((start, end))
            elif ":" in name and "::" not in name:
                op_name, op_type = name.rsplit(":", 1)
                events.append((start, end, op_name, op_type))
    if not steps:
        raise RuntimeError(f"no train step found in the trace of {folder}")
    step_start, step_end = max(steps)
    ops = sorted(e for e in events if step_start <= e[0] <= step_end)
    return step_start, step_end, ops
