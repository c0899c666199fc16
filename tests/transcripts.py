"""Transcripts in the docs, written by the tests that run what they show.

A page shows what a command printed (`docs/transcripts/NAME.txt`, included
with `--8<--`). The test that runs the command checks the committed
transcript against its own run, lines compared with their numbers, paths
and durations masked (they change from run to run) and in any order (the
tasks of a job print in the order they run); with
`KERAS_DIST_WRITE_TRANSCRIPTS=1` it writes the transcript instead. So a
transcript cannot fall behind what the code prints.
"""

import os
import re

from helpers import REPO_ROOT

FOLDER = os.path.join(REPO_ROOT, "docs", "transcripts")
_MASKS = [
    (re.compile(r"/\S*(?:tmp|keras-dist-logs|keras_dist)\S*"), "PATH"),
    (re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?"), "N"),
    (re.compile(r"[ \t]+"), " "),
]


# The chief's line saying its sums go through gloo: printed where PyTorch is
# installed (the test environment), not in a plain `pip install .`. Shown in
# a transcript or not, compared nowhere.
_BACKEND_LINE = r"keras_dist: gradients sum through gloo \("


def normalized(text: str) -> list[str]:
    lines = []
    for line in text.strip().splitlines():
        for pattern, replacement in _MASKS:
            line = pattern.sub(replacement, line)
        lines.append(line.strip())
    return sorted(lines)


def check(name: str, text: str, ignore: str | None = None) -> None:
    """Writes (`KERAS_DIST_WRITE_TRANSCRIPTS=1`) or checks a transcript.

    `ignore`: a regular expression; lines it matches are shown but not
    compared (a diagnosis worded by whichever check saw a loss first).
    """
    path = os.path.join(FOLDER, f"{name}.txt")
    if os.environ.get("KERAS_DIST_WRITE_TRANSCRIPTS", "").strip() == "1":
        os.makedirs(FOLDER, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text.strip() + "\n")
        return
    with open(path) as handle:
        committed = handle.read()
    skipped = re.compile("|".join([_BACKEND_LINE, *([ignore] if ignore else [])]))

    def compared(lines: str) -> list[str]:
        kept = [x for x in lines.strip().splitlines() if not skipped.search(x)]
        return normalized("\n".join(kept))

    assert compared(committed) == compared(text), (
        f"{path} no longer shows what the command prints; rerun this test with "
        f"KERAS_DIST_WRITE_TRANSCRIPTS=1 to write it again. This run:\n{text}"
    )
