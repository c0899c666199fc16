"""The package's structure: layers, no import loop, short modules, a core
without Keras, a tf_keras front end that loads no Keras 3.

The import graph is read from the source (every `import` and `from ...
import` of a `keras_dist` module, at module level or inside a function; the
implicit import of a parent package does not count).
"""

import ast
import collections

import pytest
from helpers import REPO_ROOT, run_python

PACKAGE = REPO_ROOT / "keras_dist"

# Lowest first. A module may import modules of its own layer or below, never
# above; within a layer the graph must have no loop. The first match of a
# module's name (exact, or a package prefix ending in ".") decides.
LAYERS = [
    (
        "foundations (no Keras)",
        [
            "keras_dist._backend",
            "keras_dist._versions",
            "keras_dist._validation",
            "keras_dist._compat",
            "keras_dist._compat.tf_internal",
            "keras_dist._compat.tf_keras_src",
            "keras_dist.noise_scale",
            "keras_dist.cluster",
            "keras_dist.launcher",
            "keras_dist.launcher.",
            "keras_dist.parameter_server",
            "keras_dist.parameter_server.serving",
            "keras_dist._strategies",
        ],
    ),
    ("core (no Keras)", ["keras_dist.core", "keras_dist.core."]),
    (
        "Keras 3 foundations",
        [
            "keras_dist._compat.keras_src",
            "keras_dist._compat.parameter_servers",
            "keras_dist._registration",
            "keras_dist.compression",
            "keras_dist._apply",
            "keras_dist._wrapper",
            "keras_dist.optimizers",
            "keras_dist._shards",
            "keras_dist._owned",
            "keras_dist._sharding_checks",
            "keras_dist.sharding",
            "keras_dist.local_sgd",
            "keras_dist.schedules",
            "keras_dist._fit_data",
        ],
    ),
    ("training state", ["keras_dist.state"]),
    (
        "callbacks and parameter servers",
        [
            "keras_dist.backup",
            "keras_dist.backup.",
            "keras_dist.autoscale",
            "keras_dist._autoscale_state",
            "keras_dist.parameter_server.training",
        ],
    ),
    ("trainer", ["keras_dist.trainer", "keras_dist.trainer."]),
    (
        "public modules and tools",
        [
            "keras_dist.models",
            "keras_dist.callbacks",
            "keras_dist.batch_size",
            "keras_dist.memory",
            "keras_dist.strategy",
            "keras_dist.testing",
            "keras_dist.tf_keras",
        ],
    ),
    (
        "applications",
        ["keras_dist", "keras_dist.demo", "keras_dist._demo_fault", "keras_dist.cli"],
    ),
    ("entry point", ["keras_dist.__main__"]),
]

# What the Keras-free parts may import besides their own layer.
KERAS_FREE = {
    "keras_dist.core.": {
        "keras_dist._validation",
        "keras_dist._versions",
        "keras_dist.cluster",
        "keras_dist._compat.tf_internal",
    },
    "keras_dist.tf_keras": {
        "keras_dist._validation",
        "keras_dist._backend",
        "keras_dist._compat.tf_keras_src",
    },
}

MAX_LINES = 750  # "about 700": a module past it gets split


def _modules():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _import_graph():
    modules = _modules()
    edges = collections.defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in names if t in modules]
                if len(targets) < len(names):
                    targets.append(base)
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return modules, edges


def _layer(module):
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (
                pattern.endswith(".") and module.startswith(pattern)
            ):
                return index
    raise AssertionError(
        f"{module} has no layer in tests/test_structure.py::LAYERS: add it."
    )


def _cycles(nodes, edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_no_import_loop():
    modules, edges = _import_graph()
    assert _cycles(modules, edges) == []


def test_no_module_imports_a_higher_layer():
    modules, edges = _import_graph()
    upward = [
        f"{source} ({LAYERS[_layer(source)][0]}) -> {target} "
        f"({LAYERS[_layer(target)][0]})"
        for source in sorted(modules)
        for target in sorted(edges[source])
        if _layer(target) > _layer(source)
    ]
    assert upward == []


@pytest.mark.parametrize("prefix", sorted(KERAS_FREE))
def test_keras_free_parts_import_only_what_they_may(prefix):
    modules, edges = _import_graph()
    allowed = KERAS_FREE[prefix]
    core = "keras_dist.core"
    wrong = {
        f"{source} -> {target}"
        for source in modules
        if source.startswith(prefix) or source == prefix.rstrip(".")
        for target in edges[source]
        if target not in allowed and not target.startswith(core)
    }
    assert wrong == set()
    for source, path in modules.items():
        if source.startswith(prefix) or source == prefix.rstrip("."):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = (
                        [a.name for a in node.names]
                        if isinstance(node, ast.Import)
                        else [node.module or ""]
                    )
                    assert not any(
                        n == "keras" or n.startswith("keras.") for n in names
                    ), f"{source} imports Keras 3"


def test_no_module_is_too_long():
    long = {
        name: count
        for name, path in _modules().items()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_core_imports_without_keras():
    # `TF_USE_LEGACY_KERAS=1`: otherwise `import tensorflow` itself loads
    # Keras 3 (TF 2.21's lazy loader for `tf.keras`). TensorFlow looks Keras
    # up (`find_spec`) without importing it, so the check is what got loaded.
    run_python(
        """
import importlib, pkgutil, sys
import keras_dist.core
for module in pkgutil.iter_modules(keras_dist.core.__path__):
    importlib.import_module(f"keras_dist.core.{module.name}")
import keras_dist.compression
hook = keras_dist.compression.PowerSGD(rank=2)
assert not [m for m in sys.modules if m == "keras" or m.startswith("keras.")]
""",
        env={"TF_USE_LEGACY_KERAS": "1"},
    )


def test_the_tf_keras_front_end_loads_no_keras_3_module():
    result = run_python(
        """
import sys
import keras_dist.tf_keras
import tf_keras
loaded = sorted(m for m in sys.modules if m == "keras" or m.startswith("keras."))
print("loaded:", loaded[:5], len(loaded))
assert loaded == [], loaded
opt = keras_dist.tf_keras.DistributedOptimizer(
    tf_keras.optimizers.SGD(0.1),
    all_reduce_hook=keras_dist.compression.FP16(),
)
assert not [m for m in sys.modules if m == "keras" or m.startswith("keras.")]
""",
        env={"TF_USE_LEGACY_KERAS": "1"},
    )
    assert "loaded: [] 0" in result.stdout
