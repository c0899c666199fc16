"""Which test files run with which substitution, and how they are copied.

A suite is a set of test files from one package (Keras's wheel, or the
tf_keras tests vendored in `tf_keras_v2_21_0/`) run together in one pytest
process. Each file runs with one substitution (`substitute.py`); a file may
run a second time under another substitution, as a variant
(`loss_scale_optimizer_test.py[outside]`), compared with the same stock ids.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TF_KERAS_TESTS = HERE / "tf_keras_v2_21_0"


@dataclass(frozen=True)
class TestFile:
    """One test file of a package, run under one substitution.

    Attributes:
        path: The file, relative to the package's test root (Keras's
            installed package folder, or `tf_keras_v2_21_0/`).
        substitution: A key of `substitute.SUBSTITUTIONS`.
        variant: Empty, or a label naming a second run of the same file
            under another substitution.
    """

    __test__ = False  # not a pytest class

    path: str
    substitution: str
    variant: str = ""

    @property
    def stock_label(self) -> str:
        """The file's name in test ids of the stock run."""
        return Path(self.path).name

    @property
    def label(self) -> str:
        """The file's name in test ids of the substituted run."""
        return self.stock_label + (f"[{self.variant}]" if self.variant else "")

    @property
    def copy_name(self) -> str:
        """The name of the copy pytest runs (a valid module name)."""
        stem = Path(self.path).stem
        return (
            f"{stem}__{self.variant.replace('-', '_')}.py"
            if self.variant
            else (f"{stem}.py")
        )


@dataclass(frozen=True)
class Suite:
    """Test files of one package, run in one pytest process per mode."""

    name: str
    package: str  # "keras" or "tf_keras": where the files and stock list are
    files: tuple[TestFile, ...]

    def stock_files(self) -> tuple[TestFile, ...]:
        """The files run stock: each once, variants left out."""
        return tuple(f for f in self.files if not f.variant)

    def by_label(self) -> dict[str, TestFile]:
        return {f.label: f for f in self.files}


def keras_root() -> Path:
    import keras

    return Path(keras.__file__).resolve().parent


def package_root(package: str) -> Path:
    """The folder test paths of `package` are relative to."""
    return keras_root() if package == "keras" else TF_KERAS_TESTS


def _glob(package, pattern, substitution, leave_out=()):
    root = package_root(package)
    paths = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern))
    left = set(leave_out)
    return tuple(TestFile(p, substitution) for p in paths if Path(p).name not in left)


def suites() -> dict[str, Suite]:
    """The suites CI runs, by name (globs resolve against the installed Keras)."""
    lso = "src/optimizers/loss_scale_optimizer_test.py"
    found = [
        Suite(
            "trainer-model",
            "keras",
            (
                TestFile("src/trainers/trainer_test.py", "model"),
                TestFile("src/models/model_test.py", "model"),
            ),
        ),
        Suite("callbacks", "keras", _glob("keras", "src/callbacks/*_test.py", "model")),
        Suite("saving", "keras", _glob("keras", "src/saving/*_test.py", "model")),
        Suite(
            "optimizers",
            "keras",
            _glob("keras", "src/optimizers/*_test.py", "optimizer")
            + _glob("keras", "src/optimizers/schedules/*_test.py", "optimizer")
            + (TestFile(lso, "optimizer-outside-loss-scale", variant="outside"),),
        ),
        Suite(
            "tf_keras-optimizers",
            "tf_keras",
            _glob("tf_keras", "**/*_test.py", "tf_keras-optimizer"),
        ),
    ]
    for suite in found:
        labels = [f.label for f in suite.files]
        if len(set(labels)) != len(labels):
            raise ValueError(f"two files of suite {suite.name} share a name: {labels}")
    return {suite.name: suite for suite in found}


def _is_import(node) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    # trainer_test binds `Trainer` in `if backend.backend() == ...:` blocks.
    if isinstance(node, (ast.If, ast.Try)):
        bodies = [
            node.body,
            node.orelse,
            *(h.body for h in getattr(node, "handlers", ())),
        ]
        return all(_is_import(n) for body in bodies for n in body)
    return False


def insert_substitution(source: str, substitution: str) -> str:
    """Inserts the substitution right after the module's leading imports.

    Before any other module-level statement, so that a list of optimizer
    classes built at import time (`TEST_CASES = [{"optimizer_class":
    optimizers.Adam}, ...]`) holds the substituted names.
    """
    body = ast.parse(source).body
    end = 0
    for index, node in enumerate(body):
        docstring = (
            index == 0
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        )
        if not (docstring or _is_import(node)):
            break
        end = node.end_lineno
    lines = source.splitlines(keepends=True)
    insert = (
        "from substitute import substitute  # noqa\n"
        f"substitute(globals(), {substitution!r})\n"
    )
    return "".join(lines[:end]) + insert + "".join(lines[end:])


_TF_KERAS_IMPORT = re.compile(r"^(\s*)(import|from) tf_keras(\.| import| as )")


def tf_keras_wheel_imports(source: str) -> str:
    """Rewrites repository imports (`tf_keras.x`) to the wheel's (`tf_keras.src.x`).

    The rule of `pip_build.py::convert_keras_imports` in keras-team/tf-keras,
    which builds the wheel from the repository, on import lines only.
    """
    out = []
    for line in source.splitlines(keepends=True):
        match = _TF_KERAS_IMPORT.match(line)
        if match and "tf_keras.protobuf" not in line:
            line = line.replace("tf_keras", "tf_keras.src", 1)
        out.append(line)
    return "".join(out)


def copy_source(package: str, test_file: TestFile, substituted: bool) -> str:
    """The text of the copy pytest runs."""
    source = (package_root(package) / test_file.path).read_text()
    if package == "tf_keras":
        source = tf_keras_wheel_imports(source)
    if substituted:
        source = insert_substitution(source, test_file.substitution)
    return source
