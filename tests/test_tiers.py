"""The suite's two tiers (CONTRIBUTING.md, "Two tiers"): `make test` leaves
out the tests marked `extended`, `make test-all` (`--extended`) runs them."""

import pathlib

from helpers import REPO_ROOT


def test_the_extended_tests_run_only_when_asked(request):
    items = request.session.items
    extended = [item for item in items if "extended" in item.keywords]
    if request.config.getoption("extended"):
        assert extended
    else:
        assert not extended, [item.nodeid for item in extended]


def test_every_file_with_extended_tests_keeps_tests_in_make_test():
    # An extended test repeats, longer or on another backend, what a test of
    # `make test` shows; its file keeps that test in CI's tier.
    for path in sorted(pathlib.Path(REPO_ROOT, "tests").glob("test_*.py")):
        text = path.read_text()
        if "pytest.mark.extended" not in text:
            continue
        tests = text.count("\ndef test_")
        whole = text.count("@pytest.mark.extended\ndef test_")
        assert tests > whole, f"{path.name}: every test is extended"
