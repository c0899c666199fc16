"""The collective watchdog (keras_dist/core/watchdog.py): one thread bounds
how long a call into TensorFlow may wait for peers, instead of TensorFlow's
thread per collective.

An abort ends a process's collectives for good, so each case runs in a fresh
interpreter. A real wait for a peer that never comes: an all-reduce of a
group of 2 with one member, which TensorFlow's runtime waits on forever.
The multi-worker cases (a peer SIGKILLed, SIGSTOPped or stuck in Python,
under `keras-dist launch`) are in test_fault_tolerance.py; the thread count
of long runs in test_soak.py.
"""

import json

from helpers import run_python

# A call that waits forever: the second member of the group never comes.
_STUCK_CALL = """
import json, sys, time
import tensorflow as tf
from tensorflow.python.ops import collective_ops
from keras_dist.core import watchdog

strategy = tf.distribute.get_strategy()

@tf.function
def lonely():
    return collective_ops.all_reduce_v2(
        tf.ones([2]), group_size=2, group_key=7, instance_key=7
    )

@tf.function
def short(x):
    return tf.numpy_function(lambda v: (time.sleep(0.1), v)[1], [x], tf.float32)
"""


def test_a_call_stuck_past_the_timeout_is_aborted():
    code = (
        _STUCK_CALL
        + """
watchdog.watch(strategy, 2.0)
start = time.monotonic()
try:
    lonely()
    outcome = "returned"
except tf.errors.DeadlineExceededError as error:
    outcome = str(error)
print(json.dumps([time.monotonic() - start, outcome, watchdog.aborted()]))
"""
    )
    seconds, outcome, aborted = json.loads(
        run_python(code, timeout=120).stdout.splitlines()[-1]
    )
    assert "keras_dist: this worker waited 2 s in one call into TensorFlow" in outcome
    assert "longer than the collective timeout (2 s" in outcome
    assert aborted is not None and aborted in outcome
    # The timeout, plus at most one poll (0.2 s here) and a loaded machine.
    assert 2.0 <= seconds < 6.0, seconds


def test_calls_shorter_than_the_timeout_and_python_are_left_alone():
    # Many short calls back to back (each a new call, though the thread is
    # nearly always inside one), a Python pause longer than the timeout,
    # and calls that each take a fifth of it: nothing is aborted.
    code = (
        _STUCK_CALL
        + """
watchdog.watch(strategy, 1.0)
end = time.monotonic() + 3
while time.monotonic() < end:
    tf.constant(1.0) + 1.0
time.sleep(2.5)
for _ in range(15):
    short(tf.constant(1.0))
print(json.dumps(watchdog.aborted()))
"""
    )
    assert json.loads(run_python(code, timeout=120).stdout.splitlines()[-1]) is None


def test_the_shortest_timeout_of_the_live_strategies_applies():
    code = """
import gc, json
import tensorflow as tf
from keras_dist.core import watchdog

first = tf.distribute.MirroredStrategy(["/cpu:0"])
second = tf.distribute.OneDeviceStrategy("/cpu:0")
watchdog.watch(first, 30.0)
watchdog.watch(second, 5.0)
watchdog.watch(first, None)  # nothing to watch: no change
bounds = [watchdog._WATCHDOG._bound()[0]]
del second
gc.collect()
bounds.append(watchdog._WATCHDOG._bound()[0])
print(json.dumps([bounds, watchdog.timeout_of(first)]))
"""
    result = json.loads(run_python(code, timeout=120).stdout.splitlines()[-1])
    assert result == [[5.0, 30.0], 30.0]
