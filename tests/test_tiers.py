"""The suite's two tiers (CONTRIBUTING.md, "Two tiers"): `make test` leaves
out the tests marked `extended`, `make test-all` (`--extended`) runs them."""

import ast
import pathlib

from helpers import REPO_ROOT

# Whole files in `make test-all` only: Keras's callbacks, saving and
# optimizer tests and tf_keras's optimizer tests with keras_dist's pieces
# (Keras's trainer and model tests with `DistributedModel` stay in
# `make test`).
WHOLE_FILES = {
    "test_keras_callbacks_saving_conformance.py",
    "test_keras_optimizers_conformance.py",
    "test_tf_keras_optimizers_conformance.py",
}


def test_the_extended_tests_run_only_when_asked(request):
    items = request.session.items
    extended = [item for item in items if "extended" in item.keywords]
    if request.config.getoption("extended"):
        assert extended
    else:
        assert not extended, [item.nodeid for item in extended]


def _is_extended(decorator) -> bool:
    return ast.unparse(decorator) == "pytest.mark.extended"


def test_only_the_listed_files_are_extended_whole():
    # An extended test repeats, longer or on another backend, what a test of
    # `make test` shows; its file keeps that test in CI's tier.
    whole = set()
    for path in sorted(pathlib.Path(REPO_ROOT, "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        tests = [
            node
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        ]
        if tests and all(
            any(_is_extended(d) for d in test.decorator_list) for test in tests
        ):
            whole.add(path.name)
    assert whole == WHOLE_FILES
