"""Plumbing the benchmark scripts share: imports, devices and the JSON report.

Each script measures something different; what they have in common is how
they start TensorFlow (logical CPU devices must be configured before it
initialises), which keras_dist they import (this checkout's, not an installed
one), and the record they leave: the exact command, the machine's state
(versions, core count, load average before and after, since this machine is
shared and noisy) and the results, as JSON beside the plot.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_stack(logical_cpus: int | None = None):
    """Imports TensorFlow, Keras and this checkout's keras_dist.

    Args:
        logical_cpus: Int or `None`. Splits the CPU into this many logical
            devices before TensorFlow initialises. Defaults to `None` (leave
            the devices alone).

    Returns:
        `(tf, keras, keras_dist)`.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    if logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
        )
    import keras

    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import keras_dist

    return tf, keras, keras_dist


class RunClock:
    """The wall time and the machine's load over one benchmark run."""

    def __init__(self):
        self.load_average_start = os.getloadavg()
        self.started = time.perf_counter()

    def environment(self, versions: dict, **extra) -> dict:
        """Returns the report's `environment` entry.

        Args:
            versions: Dict. Library versions, e.g. from `versions()`.
            **extra: More entries (e.g. `logical_cpu_devices=2`).
        """
        return {
            "python": platform.python_version(),
            **versions,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            **extra,
            # Other work on the machine shifts absolute times; the scripts
            # compare configurations side by side to resist it.
            "load_average_start": self.load_average_start,
            "load_average_end": os.getloadavg(),
            "wall_seconds": time.perf_counter() - self.started,
        }


def versions(tf, keras, keras_dist) -> dict:
    """Returns the versions of the imported TensorFlow, Keras and keras_dist."""
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_dist": keras_dist.__version__,
    }


def command() -> str:
    """Returns the command line that ran this script."""
    return " ".join(["python", *sys.argv])


def _make_folder_of(path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)


def plot_path(out: str) -> str:
    """Returns the PNG path beside the JSON report `out`, creating its folder."""
    _make_folder_of(out)
    return os.path.splitext(out)[0] + ".png"


def write_report(out: str, report: dict) -> None:
    """Writes `report` as JSON to `out` and says what was written."""
    _make_folder_of(out)
    with open(out, "w") as handle:
        json.dump(report, handle, indent=2)
    plot = report.get("plot")
    print(f"\nWrote {out}" + (f" and {plot}" if plot else " (no plot)"))


def pyplot():
    """Returns `matplotlib.pyplot` on the Agg backend, or `None` without it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot.", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def save_figure(figure, path: str, dpi: int = 110) -> str:
    """Lays out, writes and closes `figure`; returns `path`."""
    from matplotlib import pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path
