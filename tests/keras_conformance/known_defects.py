"""Known keras_dist defects that Keras's and tf_keras's tests find (issue 26).

Each entry: a test that passes stock and fails with keras_dist substituted
because of a keras_dist bug, with the defect's letter (A-K as issue 26 names
them; L-P found by these suites) and cause. `checks.py` marks them
`xfail(strict=True)`: the suite is green while they fail, and turns red
(XPASS) when a fix makes one pass. Then delete its entry. A fix may also
uncover a second cause behind an entry (the graph-mode tests under I run
the wrapper for the first time once I is fixed): rerun
`python tests/keras_conformance/run.py --suite <suite>` and reclassify.

First recorded on keras_dist a1e040b (Keras 3.15.1, tf_keras 2.21.0, TF
2.21.0) with 155 entries in groups A-P. All are fixed: the list is empty,
and stays so unless a regression must be tracked while it is fixed. What
remains that a wrapper cannot pass, by design, is in `exceptions.py`.
"""

from __future__ import annotations

_GROUPS = []


def _by_suite(groups) -> dict[str, dict[str, str]]:
    """{suite: {test id: reason}} from (reason, {suite: [test ids]}) groups."""
    table: dict[str, dict[str, str]] = {}
    for reason, ids_by_suite in groups:
        for suite, ids in ids_by_suite.items():
            for test_id in ids:
                if test_id in table.setdefault(suite, {}):
                    raise ValueError(f"{suite}: {test_id} is listed twice")
                table[suite][test_id] = reason
    return table


KNOWN_DEFECTS = _by_suite(_GROUPS)
