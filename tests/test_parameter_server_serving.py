"""Tests for keras_dist.parameter_server.serving.

A task really serving is tested where its two callers start it: through
`keras-dist launch --ps` (`test_cli.py::test_ps_task_serves_until_the_workers_finish`)
and through `auto_strategy()` on a `ps` or `worker` task
(`test_parameter_server.py::test_auto_strategy_serves_on_ps_and_worker_tasks`).
"""

import ast
import pathlib
import sys

import pytest

from keras_dist import parameter_server
from keras_dist.parameter_server import serving


@pytest.mark.parametrize(
    ("task_type", "task_index"), [("evaluator", 0), ("ps", 1), ("worker", -1)]
)
def test_a_task_outside_the_cluster_is_refused_before_serving(task_type, task_index):
    cluster = {"worker": ["localhost:1"], "ps": ["localhost:2"]}
    with pytest.raises(ValueError, match=r"must name a task of `cluster_spec`"):
        serving.serve(cluster, task_type, task_index)


def test_serving_imports_only_tensorflow_and_the_standard_library():
    # A launcher's ps task (`python -m keras_dist _ps-server`) pays for
    # TensorFlow, never for Keras or the rest of keras_dist (TensorFlow 2.21
    # itself imports Keras, so `sys.modules` cannot tell).
    for path in (serving.__file__, parameter_server.__file__):
        tree = ast.parse(pathlib.Path(path).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
        allowed = {"tensorflow", "__future__", *sys.stdlib_module_names}
        assert imported <= allowed, (path, imported - allowed)
