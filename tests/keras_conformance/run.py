"""Runs Keras's and tf_keras's own tests stock or with keras_dist substituted.

    python tests/keras_conformance/run.py --suite callbacks --out results.json
    python tests/keras_conformance/run.py --record        # refresh stock lists
    python tests/keras_conformance/run.py --table         # docs/conformance.md

The suites (`suites.py`): `trainer-model`, `callbacks`, `saving` (Keras's
tests with `DistributedModel`), `optimizers` (Keras's, with
`GradientAccumulationOptimizer(Cls(...), 1)`) and `tf_keras-optimizers`
(tf_keras's, vendored from keras-team/tf-keras v2.21.0, with
`keras_dist.tf_keras.DistributedOptimizer`).

Each test file is copied into a temporary folder. In `distributed` mode one
line is inserted after the file's imports,
`from substitute import substitute; substitute(globals(), "<substitution>")`,
which rebinds names in that module only (see `substitute.py`). pytest then
runs the copies in a fresh interpreter, and its JUnit XML gives the outcome
of every test id (the same ids in both modes; a variant's file shows as
`name.py[variant]`).

`--record` runs the files stock and writes the ids that pass to
`stock_passing/<package>-<version>.txt`: the suite compares against that
file instead of running stock every time. Refresh it whenever the pinned
Keras or tf_keras version changes (the suite runs stock itself, slower,
when the file for the installed version is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import suites as suite_table  # noqa: E402

STOCK_DIR = HERE / "stock_passing"
# What Keras's repository conftest gives its tests (the wheel ships none):
# the markers, and `skip_if_backend`, which remote_monitor_test imports.
_CONFTEST = """\
import os
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest


def pytest_configure(config):
    for marker in ("requires_trainable_backend", "skip_if_backend"):
        config.addinivalue_line("markers", marker)


def skip_if_backend(given_backend, reason):
    from keras.src.backend import backend

    return pytest.mark.skipif(backend() == given_backend, reason=reason)
"""
_MODES = ("stock", "distributed")


@dataclass(frozen=True)
class Result:
    """One test's outcome ("passed", "failed", "error" or "skipped")."""

    outcome: str
    message: str = ""


def package_version(package: str) -> str:
    if package == "keras":
        import keras

        return keras.__version__
    # tf_keras's version without importing it (which imports TensorFlow).
    from importlib.metadata import version

    return version("tf_keras")


def stock_list_path(package: str = "keras", version: str | None = None) -> Path:
    return STOCK_DIR / f"{package}-{version or package_version(package)}.txt"


def _environment(package: str) -> dict[str, str]:
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTEST_ADDOPTS", None)
    if package == "tf_keras":
        # As tf_keras programs run: `keras_dist.tf_keras` loads no Keras 3.
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def run(
    suite: suite_table.Suite, mode: str, timeout: float = 3600, ids=None
) -> dict[str, Result]:
    """Runs a suite's files in a fresh interpreter; returns {test id: Result}.

    `ids`: `None` for every test of the files, or the ids (as
    `expected_ids` names them) of the tests to run alone.
    """
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}. Received: mode={mode!r}.")
    files = suite.stock_files() if mode == "stock" else suite.files
    with tempfile.TemporaryDirectory(prefix="keras_conformance_") as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(_CONFTEST)
        shutil.copy(HERE / "substitute.py", folder / "substitute.py")
        labels = {}
        for test_file in files:
            source = suite_table.copy_source(
                suite.package, test_file, substituted=mode == "distributed"
            )
            (folder / test_file.copy_name).write_text(source)
            labels[Path(test_file.copy_name).stem] = (
                test_file.label if mode == "distributed" else test_file.stock_label
            )
        report = folder / "report.xml"
        targets = [f.copy_name for f in files] if ids is None else _node_ids(files, ids)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-o",
            "junit_family=xunit1",
            # A file that cannot be imported (orbax_checkpoint_test without
            # orbax) fails alone, not the whole run.
            "--continue-on-collection-errors",
            "--rootdir",
            str(folder),
            f"--junitxml={report}",
            *targets,
        ]
        completed = subprocess.run(
            command,
            cwd=folder,
            env=_environment(suite.package),
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
        if not report.exists():
            raise RuntimeError(
                f"pytest wrote no report; command: {command}\n"
                f"{completed.stdout[-3000:]}{completed.stderr[-3000:]}"
            )
        return parse_junit(report.read_text(), labels)


def _node_ids(files, ids) -> list[str]:
    """pytest's node ids, in the copied files, of the tests `ids` name."""
    nodes = []
    for test_id in ids:
        test_file = next(f for f in files if test_id.startswith(f.label + "::"))
        nodes.append(test_file.copy_name + test_id[len(test_file.label) :])
    return nodes


def parse_junit(text: str, labels: dict[str, str]) -> dict[str, Result]:
    """{test id: Result} from JUnit XML; `labels` maps module names to files."""
    results = {}
    for case in ET.fromstring(text).iter("testcase"):
        module, *classes = case.get("classname", "").split(".")
        test_id = "::".join([labels.get(module, module + ".py"), *classes])
        test_id += "::" + case.get("name")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
        results[test_id] = Result(outcome, message.strip())
    return results


def read_stock_list(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def stock_ids(suite: suite_table.Suite) -> set[str] | None:
    """The suite's recorded stock-passing ids, or None with no list recorded."""
    path = stock_list_path(suite.package)
    if not path.exists():
        return None
    labels = {f.stock_label for f in suite.files}
    return {i for i in read_stock_list(path) if i.split("::")[0] in labels}


def expected_ids(suite: suite_table.Suite, stock: set[str]) -> list[str]:
    """Substituted-run ids that must pass: each stock id, once per variant."""
    expected = []
    for test_file in suite.files:
        prefix = test_file.stock_label + "::"
        for test in sorted(stock):
            if test.startswith(prefix):
                expected.append(test_file.label + test[len(test_file.stock_label) :])
    return expected


def record(suite: suite_table.Suite) -> Path:
    """Runs `suite` stock; rewrites its files' lines of the stock list."""
    results = run(suite, "stock")
    path = stock_list_path(suite.package)
    labels = {f.stock_label for f in suite.files}
    kept = set()
    if path.exists():
        kept = {i for i in read_stock_list(path) if i.split("::")[0] not in labels}
    passing = kept | {i for i, r in results.items() if r.outcome == "passed"}
    name = "Keras" if suite.package == "keras" else "tf_keras"
    header = (
        f"# {name} {package_version(suite.package)}: tests that pass stock "
        "(TensorFlow backend, CPU).\n# Written by "
        "`python tests/keras_conformance/run.py --record`.\n"
    )
    STOCK_DIR.mkdir(exist_ok=True)
    path.write_text(header + "\n".join(sorted(passing)) + "\n")
    return path


TABLE_HEADER = (
    "| file | stock pass | substituted pass | lost | of which exceptions "
    "| of which known defects |\n| --- | ---: | ---: | ---: | ---: | ---: |"
)


def table(suite: suite_table.Suite, stock: set[str], results: dict[str, Result]):
    """Markdown rows per file: the stock-passing tests, and how they fare."""
    from exceptions import EXCEPTIONS
    from known_defects import KNOWN_DEFECTS

    exceptions = EXCEPTIONS.get(suite.name, {})
    defects = KNOWN_DEFECTS.get(suite.name, {})
    rows = []
    for test_file in suite.files:
        expected = [
            t
            for t in expected_ids(suite, stock)
            if t.startswith(test_file.label + "::")
        ]
        lost = [
            t for t in expected if getattr(results.get(t), "outcome", "") != "passed"
        ]
        rows.append(
            f"| `{test_file.label}` | {len(expected)} | {len(expected) - len(lost)} "
            f"| {len(lost)} | {sum(t in exceptions for t in lost)} "
            f"| {sum(t in defects for t in lost)} |"
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--suite",
        action="append",
        choices=sorted(suite_table.suites()),
        help="a suite to run (repeatable); all suites by default",
    )
    parser.add_argument("--mode", choices=_MODES, default="distributed")
    parser.add_argument(
        "--out", help="write {suite/test id: [outcome, message]} as JSON here"
    )
    parser.add_argument(
        "--record", action="store_true", help="run stock and write the stock lists"
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the per-file table (recorded stock list vs a substituted run)",
    )
    args = parser.parse_args(argv)
    chosen = [suite_table.suites()[n] for n in args.suite or suite_table.suites()]
    everything = {}
    for suite in chosen:
        start = time.monotonic()
        if args.record:
            print(f"{suite.name}: wrote {record(suite)}")
            continue
        results = run(suite, args.mode)
        seconds = time.monotonic() - start
        everything.update(
            {f"{suite.name}/{k}": [v.outcome, v.message] for k, v in results.items()}
        )
        counts = {}
        for result in results.values():
            counts[result.outcome] = counts.get(result.outcome, 0) + 1
        print(f"{suite.name} ({args.mode}, {seconds:.0f} s): {counts}")
        if args.table:
            stock = stock_ids(suite) or set()
            print(TABLE_HEADER)
            print("\n".join(table(suite, stock, results)))
    if args.out:
        Path(args.out).write_text(json.dumps(everything, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
