"""The convention for code blocks in README.md and docs/ holds, and it bites.

The blocks themselves run as tests through pytest-markdown-docs (the root
`conftest.py`; "Code blocks in the docs" in CONTRIBUTING.md). This module
checks what that run cannot: every Python block is either run or marked
`{.python notest}` with its reason on the line above, the marker renders as
highlighted code on the site, the home page's includes resolve, and a broken
block really fails the suite.
"""

import re
import shutil
import subprocess
import sys

import markdown
import pytest
from helpers import REPO_ROOT
from markdown_it import MarkdownIt

PAGES = sorted(
    [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")],
    key=str,
)
NOTEST_REASON = re.compile(r"^\s*<!--\s*notest:\s*(\S.*?)\s*-->\s*$")
PYTHON_LIKE = re.compile(r"^\{?\s*\.?(py|python|python3|pycon)\b")


def fences(path):
    """(line number of the fence, info string) of every fenced block."""
    text = path.read_text(encoding="utf-8")
    tokens = MarkdownIt("commonmark").parse(text)
    return text.splitlines(), [
        (token.map[0], token.info.strip()) for token in tokens if token.type == "fence"
    ]


def page_id(path):
    return str(path.relative_to(REPO_ROOT))


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_python_blocks_run_or_say_why_not(path):
    lines, blocks = fences(path)
    for index, info in blocks:
        where = f"{page_id(path)}:{index + 1}"
        if not PYTHON_LIKE.match(info):
            continue
        if info == "python":
            continue
        assert info == "{.python notest}", (
            f"{where}: a Python block is fenced ```python (runs) or "
            f"```{{.python notest}} (cannot run here), not ```{info}. The plain "
            "`python notest` form renders as broken text on the site."
        )
        above = lines[index - 1] if index else ""
        assert NOTEST_REASON.match(above), (
            f"{where}: a `notest` block needs its reason on the line above, "
            f"e.g. `<!-- notest: needs a GPU -->`. Found: {above!r}"
        )


def test_the_pages_have_blocks_that_run():
    running = sum(info == "python" for path in PAGES for _, info in fences(path)[1])
    # README's example, the quickstart, every task page, the guides.
    assert running >= 20, running


def test_the_notest_marker_renders_as_highlighted_python():
    source = "<!-- notest: needs a GPU -->\n```{.python notest}\nimport keras\n```\n"
    html = markdown.markdown(
        source, extensions=["pymdownx.superfences", "pymdownx.highlight"]
    )
    assert 'class="highlight"' in html, html
    assert "notest" not in html.replace("<!-- notest: needs a GPU -->", ""), html


def test_the_home_page_includes_existing_readme_sections():
    index = (REPO_ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    sections = re.findall(r'^--8<-- "README\.md:([\w-]+)"$', index, re.M)
    assert sections, "docs/index.md no longer includes the README"
    for name in sections:
        assert f"--8<-- [start:{name}]" in readme, name
        assert f"--8<-- [end:{name}]" in readme, name


BROKEN_PAGE = """# A page

```python
print("this block runs")
```

```python
import json

json.loads("{not json")  # broken on purpose
```

<!-- notest: needs a GPU -->
```{.python notest}
raise SystemExit("a notest block must not run")
```
"""


def test_a_broken_block_fails_the_suite(tmp_path):
    # The repository's own configuration and runner, on a page with one good
    # and one broken block.
    shutil.copy(REPO_ROOT / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(BROKEN_PAGE, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "docs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "1 failed, 1 passed" in output, output
    assert "docs/page.md:7 failed" in output, output
    assert "JSONDecodeError" in output, output
    assert "line 10" in output, output  # the page's own line number
