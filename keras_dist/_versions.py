"""Which Keras and TensorFlow versions keras_dist accepts, and the check at import.

keras_dist patches private Keras API (`_compat.py`), so a version it was not
tested with may train wrongly rather than fail. The policy, checked when
`keras_dist` is imported (from the installed packages' metadata, without
importing TensorFlow):

- **tested** (`TESTED_KERAS`, `TESTED_TENSORFLOW`): silent;
- **accepted** (from the declared minimums, Keras 3.5 and TensorFlow 2.16,
  up, but untested): an `UntestedVersionWarning` that names the tested range;
- **refused** (Keras 2, Keras 3 before 3.5, TensorFlow before 2.16):
  `ImportError` with the fix.

The compatibility table in the README lists the same ranges.
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings

VERSION = "0.1.0"
"""keras_dist's own version (`keras_dist.__version__`)."""

# The versions the test suite ran on and every touch in `_compat.py` was
# verified against (major.minor, inclusive). Bump them together with
# tests/keras_conformance/stock_passing/ (see CONTRIBUTING.md).
TESTED_KERAS = ("3.15", "3.15")
TESTED_TENSORFLOW = ("2.21", "2.21")
# The PyTorch whose gloo process group the optional gloo backend is tested
# with (CPU workers' sums where PyTorch is installed); setup.cfg's `gloo`
# and `test` extras pin it.
TESTED_TORCH = "2.13.0"
# The minimums setup.cfg declares; older releases are refused.
MINIMUM_KERAS = "3.5"
MINIMUM_TENSORFLOW = "2.16"

# TensorFlow ships under several distribution names.
_TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-macos",
    "tensorflow-intel",
    "tf-nightly",
)


class UntestedVersionWarning(UserWarning):
    """Keras or TensorFlow is newer or older than the versions keras_dist was
    tested with (but not below its minimums)."""


def _minor(version: str) -> tuple[int, int]:
    """`"3.15.1"` -> `(3, 15)`; pre-release tails (`"2.22.0rc1"`) are dropped."""
    parts = []
    for part in version.split(".")[:2]:
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts)


def installed_version(name: str) -> str | None:
    """The installed version of `"keras"` or `"tensorflow"`, or `None`.

    An imported module's `__version__` wins over package metadata (a source
    build may have none).
    """
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    if version:
        return version
    names = _TENSORFLOW_DISTRIBUTIONS if name == "tensorflow" else (name,)
    for distribution in names:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions(
    keras_version: str | None = None, tensorflow_version: str | None = None
) -> None:
    """Applies the version policy to the given (default: installed) versions.

    Args:
        keras_version: String or `None`. `None` reads the installed Keras.
            Defaults to `None`.
        tensorflow_version: String or `None`. `None` reads the installed
            TensorFlow. Defaults to `None`.

    Raises:
        ImportError: a version is below keras_dist's minimum.

    Warns:
        UntestedVersionWarning: a version is outside the tested range.
    """
    checks = (
        ("Keras", "keras", keras_version, MINIMUM_KERAS, TESTED_KERAS),
        (
            "TensorFlow",
            "tensorflow",
            tensorflow_version,
            MINIMUM_TENSORFLOW,
            TESTED_TENSORFLOW,
        ),
    )
    for label, package, version, minimum, tested in checks:
        if version is None:
            version = installed_version(package)
        if version is None:
            # Not installed: importing it will say so, with its own error.
            continue
        low, high = tested
        tested_text = low if low == high else f"{low} to {high}"
        if _minor(version) < _minor(minimum):
            raise ImportError(
                f"keras_dist needs {label} >= {minimum}. Received: {label} "
                f"{version}. keras_dist is tested with {label} {tested_text}: "
                f'`pip install "{package}>={minimum}"` (or install keras_dist '
                "again, which pulls a compatible version)."
            )
        if not _minor(low) <= _minor(version) <= _minor(high):
            warnings.warn(
                f"keras_dist is tested with {label} {tested_text}, and "
                f"{label} {version} is installed. keras_dist patches private "
                f"{label} API, so check your results against a single device "
                "(or run keras_dist's test suite) before trusting them. "
                "Silence this with warnings.filterwarnings('ignore', "
                "category=UserWarning, message='keras_dist is tested with').",
                UntestedVersionWarning,
                stacklevel=2,
            )
