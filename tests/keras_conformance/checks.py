"""The pytest side: one test item per stock-passing test id of a suite.

Each `tests/test_*conformance*.py` file holds one or two suites, so that
pytest-xdist (`--dist loadfile`) runs them on different workers; its
module-scoped fixture runs a suite's substituted files once (`run.py`), and
every stock-passing id becomes an item that asserts "passed". An id on
`exceptions.EXCEPTIONS` (what a wrapper cannot be) or
`known_defects.KNOWN_DEFECTS` (keras_dist bugs being fixed) is marked
`xfail(strict=True)`: it must fail, and the suite turns red when it passes,
so the entry gets removed.
"""

from __future__ import annotations

import functools

import pytest
import run
import suites
from exceptions import EXCEPTIONS
from known_defects import KNOWN_DEFECTS

NO_STOCK_LIST = "no-stock-list"
LISTS = "exception-and-defect-lists"
# `make test` runs every N-th expected test of these suites (a fixed
# stride, so every test class keeps some); `make test-all` runs them all
# (CONTRIBUTING.md, "Two tiers").
SAMPLED = {"trainer-model": 2}


def cases(suite_name: str) -> list:
    """`pytest.param`s for `suite_name`: its expected ids, marked."""
    suite = suites.suites()[suite_name]
    stock = run.stock_ids(suite)
    if stock is None:
        return [pytest.param(NO_STOCK_LIST, id=f"{suite_name}-{NO_STOCK_LIST}")]
    exceptions = EXCEPTIONS.get(suite_name, {})
    defects = KNOWN_DEFECTS.get(suite_name, {})
    params = [pytest.param(LISTS, id=f"{suite_name}-{LISTS}")]
    expected = run.expected_ids(suite, stock)
    sampled = _sample(suite_name, expected)
    for test_id in expected:
        marks = []
        reason = exceptions.get(test_id) or defects.get(test_id)
        if reason is not None:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        if test_id not in sampled:
            marks.append(pytest.mark.extended)
        params.append(pytest.param(test_id, marks=marks, id=test_id))
    return params


def _sample(suite_name: str, ids: list) -> set:
    """The ids `make test` runs: every `SAMPLED[suite_name]`-th, or all."""
    return set(ids[:: SAMPLED.get(suite_name, 1)])


@functools.cache
def results(suite_name: str, everything: bool = True) -> dict[str, run.Result]:
    """The suite's substituted run, once per process: every test, or
    (`everything=False`) the sample `make test` checks."""
    suite = suites.suites()[suite_name]
    ids = None
    if not everything and suite_name in SAMPLED:
        expected = run.expected_ids(suite, run.stock_ids(suite))
        ids = sorted(_sample(suite_name, expected))
    return run.run(suite, "distributed", ids=ids)


def check(suite_name: str, test_id: str, everything: bool = True) -> None:
    """Fails unless `test_id` passed in the suite's substituted run
    (`everything`: of all its tests, else of `make test`'s sample)."""
    if test_id == NO_STOCK_LIST:
        _check_against_stock_run(suite_name)
        return
    if test_id == LISTS:
        _check_lists(suite_name)
        return
    result = results(suite_name, everything).get(test_id)
    if result is None:
        pytest.fail(f"{test_id} did not run with keras_dist substituted")
    if result.outcome != "passed":
        pytest.fail(
            f"{test_id} passes stock but is {result.outcome} with keras_dist "
            f"substituted:\n{result.message[-4000:]}",
            pytrace=False,
        )


def _check_lists(suite_name: str) -> None:
    # An entry for a test that no longer passes stock (or was renamed by a
    # new Keras) would silently stop meaning anything.
    suite = suites.suites()[suite_name]
    expected = set(run.expected_ids(suite, run.stock_ids(suite)))
    exceptions = set(EXCEPTIONS.get(suite_name, {}))
    defects = set(KNOWN_DEFECTS.get(suite_name, {}))
    both = sorted(exceptions & defects)
    assert not both, f"listed as exception and as known defect: {both}"
    unknown = sorted((exceptions | defects) - expected)
    assert not unknown, (
        "exceptions.py / known_defects.py list tests that are not stock-passing "
        f"tests of suite {suite_name!r}:\n" + "\n".join(unknown)
    )


def _check_against_stock_run(suite_name: str) -> None:
    # No list recorded for the installed version: run stock here (slower).
    suite = suites.suites()[suite_name]
    stock = {t for t, r in run.run(suite, "stock").items() if r.outcome == "passed"}
    outcomes = results(suite_name)
    listed = set(EXCEPTIONS.get(suite_name, {})) | set(
        KNOWN_DEFECTS.get(suite_name, {})
    )
    lost = sorted(
        test_id
        for test_id in run.expected_ids(suite, stock)
        if test_id not in listed
        and getattr(outcomes.get(test_id), "outcome", None) != "passed"
    )
    assert not lost, (
        f"{len(lost)} tests pass stock but not with keras_dist substituted "
        f"(record the stock list: {run.stock_list_path(suite.package).name}):\n"
        + "\n".join(lost)
    )
