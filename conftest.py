"""Every Python code block of README.md and docs/ runs as a test.

Collection and parsing are pytest-markdown-docs's (its `MarkdownTextFile`
collector, with the pymdownx.superfences fence syntax that Material for MkDocs
renders). What this file adds is where a block runs: each block is written to
a file and run as `python block.py` in a fresh interpreter, from an empty
temporary folder, without `TF_CONFIG`, so a block is exactly what a reader
copies into a file and runs. A fresh interpreter matters here: TensorFlow
fixes its device list when it first initialises (the test session has
already made 4 logical CPUs), `init_memory_growth` must run before that, and
a block that sets a global mixed-precision policy would leak into the next.

The convention ("Code blocks in the docs" in CONTRIBUTING.md):
```` ```python ```` blocks run; a block that cannot run here is fenced
```` ```{.python notest} ```` with `<!-- notest: the reason -->` on the line
above (tests/test_doc_snippets.py checks both). `pytest README.md docs` runs
only the blocks; `-m "not markdown-docs"` skips them.
"""

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from pytest_markdown_docs import _runners
from pytest_markdown_docs.plugin import MarkdownTextFile

REPO_ROOT = pathlib.Path(__file__).resolve().parent
# A block gets this long; the slowest page's script takes about 30 s alone.
BLOCK_TIMEOUT_S = 600
# The lines of a failing block's output shown in the report.
OUTPUT_TAIL_LINES = 60


class SnippetFailed(Exception):
    """A code block exited with an error; carries its output."""

    def __init__(self, path, returncode, output):
        super().__init__(f"{path} exited with code {returncode}")
        self.path = path
        self.returncode = returncode
        self.output = output


@_runners.register_runner(default=True)
class FreshInterpreterRunner(_runners._Runner):
    """Runs a block as `python block.py` in a new process.

    The block keeps the Markdown file's line numbers (pytest-markdown-docs
    pads it with blank lines), so a traceback names the page's own line.
    """

    def runtest(self, test, args, **_):
        source_path = pathlib.Path(test.source_path)
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        env["KERAS_BACKEND"] = "tensorflow"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        with tempfile.TemporaryDirectory(prefix="snippet-") as workdir:
            # Named after the page, so the traceback reads "quickstart.md.py".
            script = pathlib.Path(workdir) / f"{source_path.name}.py"
            script.write_text(test.source, encoding="utf-8")
            try:
                result = subprocess.run(
                    [sys.executable, str(script)],
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired as error:
                output = (error.stdout or "") + (error.stderr or "")
                if isinstance(output, bytes):
                    output = output.decode(errors="replace")
                raise SnippetFailed(source_path, "timeout", output) from None
        if result.returncode != 0:
            raise SnippetFailed(
                source_path, result.returncode, result.stdout + result.stderr
            )

    def repr_failure(self, test, excinfo, style=None):
        error = excinfo.value
        if not isinstance(error, SnippetFailed):
            return str(excinfo.getrepr(style=style))
        tail = "\n".join(error.output.rstrip().splitlines()[-OUTPUT_TAIL_LINES:])
        return (
            f"The code block fenced at {error.path}:{test.start_line} failed "
            f"(exit code {error.returncode}) when run alone as a script.\n"
            f"Its output (last {OUTPUT_TAIL_LINES} lines; 'line N' is the "
            f"page's line N):\n{tail}"
        )


def _is_documentation(path):
    path = pathlib.Path(path).resolve()
    if path.suffix != ".md":
        return False
    if path == REPO_ROOT / "README.md":
        return True
    return (REPO_ROOT / "docs") in path.parents


def pytest_collect_file(file_path, parent):
    # `--markdown-docs` would make the plugin collect these files itself (and
    # every .py file's docstrings); then this hook stands aside.
    if parent.config.option.markdowndocs:
        return None
    if _is_documentation(file_path):
        return MarkdownTextFile.from_parent(parent, path=pathlib.Path(file_path))
    return None


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        default=False,
        help="also run the tests marked `extended` (`make test-all`); "
        "without it they are deselected",
    )


def pytest_collection_modifyitems(config, items):
    # The tiers (CONTRIBUTING.md, "Two tiers"): `make test` (CI, the README's
    # command) runs everything but `extended`; `make test-all` adds it.
    # Deselected, not skipped: pytest's summary counts them as deselected.
    if not config.getoption("extended"):
        left_out = [item for item in items if "extended" in item.keywords]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if "extended" not in item.keywords]
    # A block that starts worker processes is a multi-worker test like any
    # other: `-m "not multiworker"` skips it too.
    for item in items:
        code = getattr(item, "code", None)
        if (
            isinstance(item.parent, MarkdownTextFile)
            and code
            and "run_workers(" in code
        ):
            item.add_marker(pytest.mark.multiworker)
