"""Runs Keras's own test files against stock Keras or `DistributedModel`.

    python tests/keras_conformance/run.py --mode distributed --out results.json
    python tests/keras_conformance/run.py --record   # refresh the stock list

Each test file is copied from the installed Keras wheel into a temporary
folder. In `distributed` mode one line is inserted after the file's imports,
`from substitute import substitute; substitute(globals())`, which rebinds the
model names in that module only (see `substitute.py`). pytest then runs the
copy in a fresh interpreter, and its JUnit XML gives the outcome of every
test id (ids are the same in both modes).

`--record` runs the files stock and writes the ids that pass to
`stock_passing/keras-<version>.txt`: the suite compares against that file
instead of running stock Keras every time. Refresh it whenever the pinned
Keras version changes (the suite runs stock itself, slower, when the file for
the installed version is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_FILES = ("src/trainers/trainer_test.py", "src/models/model_test.py")
STOCK_DIR = HERE / "stock_passing"
_INSERT = "from substitute import substitute  # noqa\nsubstitute(globals())\n"
_CONFTEST = """\
import os
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
    for marker in ("requires_trainable_backend", "skip_if_backend"):
        config.addinivalue_line("markers", marker)
"""


def keras_root() -> Path:
    import keras

    return Path(keras.__file__).resolve().parent


def keras_version() -> str:
    import keras

    return keras.__version__


def stock_list_path(version: str | None = None) -> Path:
    return STOCK_DIR / f"keras-{version or keras_version()}.txt"


def insert_substitution(source: str) -> str:
    """Inserts the substitution before the first top-level class or def.

    trainer_test binds `Trainer` in an `if backend.backend() == ...` block
    after its imports, so the line goes after every module-level statement
    that precedes the first definition.
    """
    match = re.search(r"^(class|def|@)", source, flags=re.MULTILINE)
    if match is None:
        raise ValueError("no top-level class or function in the test file")
    return source[: match.start()] + _INSERT + "\n\n" + source[match.start() :]


def prepare(folder: Path, mode: str, files=TEST_FILES) -> list[Path]:
    """Copies the Keras test files (and the conftest) into `folder`."""
    (folder / "conftest.py").write_text(_CONFTEST)
    shutil.copy(HERE / "substitute.py", folder / "substitute.py")
    copies = []
    for relative in files:
        source = (keras_root() / relative).read_text()
        if mode == "distributed":
            source = insert_substitution(source)
        copy = folder / Path(relative).name
        copy.write_text(source)
        copies.append(copy)
    return copies


def run(mode: str, files=TEST_FILES, timeout: float = 1800) -> dict[str, str]:
    """Runs the files in a fresh interpreter; returns {test id: outcome}.

    Outcomes are "passed", "failed", "error" or "skipped".
    """
    if mode not in ("stock", "distributed"):
        raise ValueError(f"mode must be 'stock' or 'distributed', got {mode!r}")
    with tempfile.TemporaryDirectory(prefix="keras_conformance_") as tmp:
        folder = Path(tmp)
        copies = prepare(folder, mode, files)
        report = folder / "report.xml"
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("PYTEST_ADDOPTS", None)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(folder),
            f"--junitxml={report}",
            *[str(c) for c in copies],
        ]
        subprocess.run(
            command,
            cwd=folder,
            env=env,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report; command: {command}")
        return parse_junit(report.read_text())


def parse_junit(text: str) -> dict[str, str]:
    outcomes = {}
    for case in ET.fromstring(text).iter("testcase"):
        module = case.get("classname", "").split(".")
        test_id = "::".join([module[0] + ".py", *module[1:], case.get("name")])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        outcomes[test_id] = outcome
    return outcomes


def read_stock_list(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("stock", "distributed"), default="stock")
    parser.add_argument("--out", help="write {test id: outcome} as JSON here")
    parser.add_argument(
        "--record", action="store_true", help="write the stock passing list"
    )
    args = parser.parse_args(argv)
    outcomes = run("stock" if args.record else args.mode)
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(f"{args.mode if not args.record else 'stock'}: {counts}")
    if args.out:
        Path(args.out).write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    if args.record:
        STOCK_DIR.mkdir(exist_ok=True)
        passing = sorted(k for k, v in outcomes.items() if v == "passed")
        header = (
            f"# Keras {keras_version()}: tests that pass on stock Keras "
            "(TensorFlow backend, CPU).\n# Written by "
            "`python tests/keras_conformance/run.py --record`.\n"
        )
        stock_list_path().write_text(header + "\n".join(passing) + "\n")
        print(f"wrote {len(passing)} ids to {stock_list_path()}")


if __name__ == "__main__":
    main()
