"""Every install line installs the clone, with extras that setup.cfg defines.

keras_dist is not on PyPI: `pip install "keras-dist[tfmot]"` fails, or
installs someone else's package if the name is ever taken. The rule
("Install lines" in CONTRIBUTING.md): `pip install .`, `pip install
".[extra]"` (double quotes; `-e` allowed), run in the clone's root. This file
finds every `pip install` in README.md, CONTRIBUTING.md, CHANGELOG.md, the
Makefile, docs/, examples/ and keras_dist/ (the error messages), and in the
error messages as they are raised, and checks each.
"""

import configparser
import re
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

SOURCES = [
    "README.md",
    "CONTRIBUTING.md",
    "CHANGELOG.md",
    "Makefile",
    "docs/**/*.md",
    "examples/**/*.py",
    "keras_dist/**/*.py",
    "benchmarks/README.md",
]
# The argument after `pip install` (and its options): a quoted string or a
# bare word. Anything else (the end of a string literal, a line break) is
# an install line this check cannot read: write it on one line.
_INSTALL = re.compile(
    r"pip install((?:[ \t]+-[-\w]+)*)[ \t]+(\"[^\"\n]*\"|'[^'\n]*'|[^\s`'\"]+)"
)
_ANY_INSTALL = re.compile(r"pip install\b")
# The clone, with or without extras: `.` or `.[a,b]`.
_CLONE = re.compile(r"\.(?:\[(?P<extras>[\w-]+(?:,[\w-]+)*)\])?")


def _extras():
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    return config["options.extras_require"]


def _requirements(extra):
    return {
        re.split(r"[<>=\[ ]", line.strip())[0].lower()
        for line in _extras()[extra].splitlines()
        if line.strip() and not line.strip().startswith("#")
    }


def _files():
    for pattern in SOURCES:
        yield from sorted(REPO_ROOT.glob(pattern))


def install_lines():
    """Every `pip install` of the sources: `(where, options, argument)`."""
    found = []
    for path in _files():
        text = path.read_text()
        readable = {match.start(): match for match in _INSTALL.finditer(text)}
        for match in _ANY_INSTALL.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(REPO_ROOT)}:{line}"
            install = readable.get(match.start())
            if install is None:
                found.append((where, "", None))
            else:
                found.append((where, install.group(1).split(), install.group(2)))
    return found


def check_install_line(options, argument):
    """Returns what is wrong with one install line, or `None`."""
    if argument is None:
        return "no argument on the same line (keep the command on one line)"
    quoted = argument[0] in "\"'" and argument[-1] == argument[0]
    value = argument[1:-1] if quoted else argument
    names_keras_dist = re.search(r"keras[-_]dist", value, re.IGNORECASE)
    if not value.startswith(".") and not names_keras_dist:
        return None  # another package (`"keras>=3.5"`, `matplotlib`)
    clone = _CLONE.fullmatch(value)
    if clone is None:
        return (
            f'installs keras_dist as {argument}: use `.` or `".[extra]"` '
            "(the clone; keras-dist is not on PyPI)"
        )
    if clone.group("extras"):
        if not argument.startswith('"'):
            return f"{argument}: put `.[extra]` in double quotes"
        unknown = set(clone.group("extras").split(",")) - set(_extras())
        if unknown:
            return f"{argument}: no extra {sorted(unknown)} in setup.cfg"
    unexpected = set(options) - {"-e", "--editable", "-q", "--quiet"}
    if unexpected:
        return f"{' '.join(options)} {argument}: unexpected options"
    return None


def test_every_install_line_installs_the_clone_with_a_defined_extra():
    lines = install_lines()
    problems = [
        f"{where}: {problem}"
        for where, options, argument in lines
        if (problem := check_install_line(options, argument))
    ]
    assert not problems, "\n".join(problems)
    # The scan sees the lines it is meant to check.
    seen = {(where.split(":")[0], argument) for where, _, argument in lines}
    for expected in [
        ("README.md", "."),
        ("README.md", '".[demo]"'),
        ("README.md", '".[tfmot]"'),
        ("README.md", '".[ray]"'),
        ("Makefile", '".[demo]"'),
        ("Makefile", '".[test]"'),
        ("docs/guides/tfmot.md", '".[tfmot]"'),
        ("docs/guides/clusters.md", '".[ray]"'),
        ("examples/ray_train.py", '".[ray]"'),
        ("examples/prune_distributed.py", '".[tfmot]"'),
        ("keras_dist/tf_keras.py", '".[tfmot]"'),
        ("keras_dist/demo.py", '".[demo]"'),
    ]:
        assert expected in seen, expected


@pytest.mark.parametrize(
    "options, argument, problem",
    [
        ([], '"keras-dist[tfmot]"', "not on PyPI"),
        ([], "keras-dist", "not on PyPI"),
        ([], "'keras-dist[demo]'", "not on PyPI"),
        ([], '"keras-dist[tfmot] @ file:///src/keras_dist"', "not on PyPI"),
        ([], ".[tfmot]", "double quotes"),
        ([], '".[gpu]"', "no extra ['gpu']"),
        ([], None, "one line"),
        (["--user"], '".[demo]"', "unexpected options"),
    ],
)
def test_the_check_refuses_what_does_not_install_the_clone(options, argument, problem):
    assert problem in check_install_line(options, argument)


@pytest.mark.parametrize(
    "options, argument",
    [
        ([], "."),
        ([], '".[demo]"'),
        ([], '".[demo,ray]"'),
        (["-e"], '".[dev]"'),
        (["--quiet", "-e"], '".[test]"'),
        ([], '"keras>=3.5"'),
        ([], "matplotlib"),
    ],
)
def test_the_check_accepts_the_clone_and_other_packages(options, argument):
    assert check_install_line(options, argument) is None


def _stderr_of(code):
    # `sys.argv = ["-m"]`: `import keras_dist` then loads no Keras pieces, as
    # under `python -m keras_dist`.
    result = subprocess.run(
        [sys.executable, "-c", 'import sys; sys.argv = ["-m"]\n' + code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, result.stderr


@pytest.mark.parametrize(
    "code, extra",
    [
        # keras_dist.tf_keras without tf_keras.
        ("sys.modules['tf_keras'] = None\nimport keras_dist.tf_keras", "tfmot"),
        # keras_dist.tf_keras.import_tfmot without tfmot.
        (
            "import importlib.util\n"
            "find_spec = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name.startswith("
            "'tensorflow_model_optimization') else find_spec(name, *a)\n"
            "sys.modules['tensorflow_model_optimization'] = None\n"
            "import keras_dist.tf_keras\n"
            "keras_dist.tf_keras.import_tfmot()",
            "tfmot",
        ),
        # The demo without scikit-learn.
        (
            "sys.modules['sklearn'] = None\n"
            "sys.modules['sklearn.datasets'] = None\n"
            "import tempfile\n"
            "from keras_dist import demo\n"
            "sys.exit(demo.main(['--out', tempfile.mkdtemp()]))",
            "demo",
        ),
    ],
    ids=["tf_keras", "tfmot", "demo"],
)
def test_error_messages_give_an_install_line_that_works(code, extra):
    returncode, stderr = _stderr_of(code)

    assert returncode != 0
    lines = [
        (options.split(), argument) for options, argument in _INSTALL.findall(stderr)
    ]
    assert lines, stderr[-2000:]
    for options, argument in lines:
        assert check_install_line(options, argument) is None, stderr[-2000:]
    assert re.search(
        rf'pip install "\.\[{extra}\]"`? in the keras_dist clone', stderr
    ), stderr[-2000:]


def test_the_test_extra_holds_the_demo_extra():
    # `make test` marks `make demo`'s install done too (the Makefile).
    assert _requirements("demo") <= _requirements("test")
    assert _requirements("tfmot") <= _requirements("test")
