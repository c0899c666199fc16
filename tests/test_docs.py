"""The documentation site builds in strict mode, and strict mode catches
broken references.

`mkdocs build --strict` (what `make docs` and CI run) fails on any warning:
a link to a missing page or anchor, a page missing from the nav, or an API
reference (`::: keras_dist...`) that does not resolve. The reference is
rendered by static analysis of the source (griffe), so these builds import
neither TensorFlow nor Keras and take seconds.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
pytest.importorskip("material", reason="mkdocs-material is not installed")
pytest.importorskip(
    "mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed"
)


# Page of the built site -> objects whose rendered API entry it must hold
# (mkdocstrings gives each entry the object's path as its HTML id).
API_PAGES = {
    "api/models/index.html": ["keras_dist.models.DistributedModel"],
    "api/optimizers/index.html": [
        "keras_dist.optimizers.GradientAccumulationOptimizer"
    ],
    "api/compression/index.html": [
        "keras_dist.compression.AllReduceHook",
        "keras_dist.compression.NoCompression",
        "keras_dist.compression.FP16",
        "keras_dist.compression.BF16",
        "keras_dist.compression.TopK",
        "keras_dist.compression.PowerSGD",
    ],
    "api/callbacks/index.html": [
        "keras_dist.callbacks.AutoScaleBatch",
        "keras_dist.callbacks.ScaledLearningRate",
    ],
    "api/noise_scale/index.html": [
        "keras_dist.noise_scale.NoiseScaleController",
        "keras_dist.noise_scale.estimate_noise",
    ],
    "api/batch_size/index.html": ["keras_dist.batch_size.find_max_batch_size"],
    "api/memory/index.html": ["keras_dist.memory.init_memory_growth"],
    "api/strategy/index.html": ["keras_dist.strategy.auto_strategy"],
    "api/cluster/index.html": ["keras_dist.cluster.make_tf_config"],
    "api/testing/index.html": ["keras_dist.testing.run_workers"],
    "api/cli/index.html": ["keras_dist.cli.launch"],
}


def build(config_file, site_dir, cwd=REPO_ROOT):
    """Runs `mkdocs build --strict`; returns the completed process."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config_file),
            "--site-dir",
            str(site_dir),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def output(result):
    return f"exit code {result.returncode}\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    result = build(os.path.join(REPO_ROOT, "mkdocs.yml"), site_dir)
    assert result.returncode == 0, output(result)
    # Strict mode aborts on warnings; INFO lines about links would be
    # references mkdocs could not check, so there must be none either.
    assert "WARNING" not in result.stderr, output(result)
    assert not re.search(r"(?i)unrecognized relative link", result.stderr), output(
        result
    )
    return site_dir


def test_site_builds_strictly_with_every_page(site):
    for page in (
        "index.html",
        "why/index.html",
        "faq/index.html",
        "tasks/which_strategy/index.html",
        "tasks/one_machine/index.html",
        "tasks/several_machines/index.html",
        "tasks/big_batch/index.html",
        "tasks/slow_network/index.html",
        "tasks/custom_loop/index.html",
        "quickstart/index.html",
        "concepts/index.html",
        "examples/index.html",
        "troubleshooting/index.html",
        "benchmarks/index.html",
        "guides/compression/index.html",
        "guides/memory/index.html",
        "guides/testing/index.html",
        "guides/mixed_precision/index.html",
    ):
        assert (site / page).is_file(), page


@pytest.mark.parametrize("page", sorted(API_PAGES))
def test_api_reference_is_rendered_from_the_docstrings(site, page):
    html = (site / page).read_text(encoding="utf-8")
    for path in API_PAGES[page]:
        assert f'id="{path}"' in html, f"{path} is not rendered on {page}"
    name = API_PAGES[page][0].rsplit(".", 1)[-1]
    assert name in html


def test_the_home_page_is_the_readme(site):
    # docs/index.md includes the README's sections: one source, no drift.
    html = (site / "index.html").read_text(encoding="utf-8")
    assert "tested on CPUs only" in html
    assert 'id="compatibility"' in html
    assert "--8&lt;--" not in html and "--8<--" not in html


def test_the_reference_hides_internals(site):
    optimizers = (site / "api/optimizers/index.html").read_text(encoding="utf-8")
    models = (site / "api/models/index.html").read_text(encoding="utf-8")
    assert "accumulate_and_apply" not in optimizers
    assert 'id="keras_dist.optimizers.GradientAccumulationOptimizer.apply"' not in (
        optimizers
    )
    assert "MultiWorkerBuildFix" not in models


def test_key_names_appear_in_the_reference(site):
    html = "".join(
        (site / page).read_text(encoding="utf-8") for page in sorted(API_PAGES)
    )
    for name in (
        "DistributedModel",
        "GradientAccumulationOptimizer",
        "AllReduceHook",
        "AutoScaleBatch",
        "PowerSGD",
        "init_memory_growth",
        "auto_strategy",
        "run_workers",
    ):
        assert name in html, name
    # Text that only the docstrings hold, so the pages are not empty shells.
    assert "accumulation_steps" in html
    assert "Vogels" in html


def test_benchmark_plots_are_copied_and_embedded(site):
    sources = sorted(
        name
        for name in os.listdir(os.path.join(REPO_ROOT, "docs", "benchmarks"))
        if name.endswith(".png")
    )
    assert len(sources) >= 8, sources
    index = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    for name in sources:
        assert (site / "benchmarks" / name).is_file(), name
        # The benchmarks index embeds every plot.
        assert f'src="{name}"' in index, f"{name} is not embedded in the index"


# --- Strictness itself --------------------------------------------------------


def copy_docs(tmp_path):
    """A copy of mkdocs.yml and docs/ whose API reference reads this repo."""
    shutil.copytree(os.path.join(REPO_ROOT, "docs"), tmp_path / "docs")
    # docs/index.md includes sections of the README (pymdownx.snippets).
    shutil.copy(os.path.join(REPO_ROOT, "README.md"), tmp_path / "README.md")
    with open(os.path.join(REPO_ROOT, "mkdocs.yml"), encoding="utf-8") as handle:
        config = handle.read()
    assert "paths: [.]" in config
    config = config.replace("paths: [.]", f"paths: [{str(REPO_ROOT)!r}]")
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    return tmp_path / "mkdocs.yml"


BROKEN = {
    "link to a missing page": ("[gone](no_such_page.md)", "no_such_page.md"),
    "link to a missing anchor": (
        "[gone](concepts.md#no-such-section)",
        "no-such-section",
    ),
    "unresolvable API reference": (
        "::: keras_dist.does_not_exist",
        "keras_dist.does_not_exist",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_strict_build_fails_on_a_broken_reference(tmp_path, case):
    snippet, culprit = BROKEN[case]
    config = copy_docs(tmp_path)
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as handle:
        handle.write(f"\n\n{snippet}\n")
    result = build(config, tmp_path / "site", cwd=tmp_path)
    assert result.returncode != 0, output(result)
    assert culprit in result.stderr + result.stdout, output(result)


def test_strict_build_fails_on_a_page_missing_from_the_nav(tmp_path):
    config = copy_docs(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n", encoding="utf-8")
    result = build(config, tmp_path / "site", cwd=tmp_path)
    assert result.returncode != 0, output(result)
    assert "orphan.md" in result.stderr + result.stdout, output(result)


def test_copied_docs_build_cleanly(tmp_path):
    # The control for the tests above: the copy itself is fine.
    config = copy_docs(tmp_path)
    result = build(config, tmp_path / "site", cwd=tmp_path)
    assert result.returncode == 0, output(result)
