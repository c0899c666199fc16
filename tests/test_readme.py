"""The README's promises hold: its example is short and its links resolve.

The example itself runs with every other code block of the README and the
docs (conftest.py, "Code blocks in the docs" in CONTRIBUTING.md).
"""

import os
import re

from helpers import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def readme():
    with open(README) as handle:
        return handle.read()


def fifteen_line_example():
    section = readme().split("## In fifteen lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_fifteen_line_example_is_short():
    lines = [line for line in fifteen_line_example().splitlines() if line.strip()]
    assert len(lines) <= 18, len(lines)


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local
    for link in local:
        assert os.path.exists(os.path.join(REPO_ROOT, link)), link
