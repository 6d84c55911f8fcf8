"""The documentation site builds with `mkdocs build --strict`: a broken link, a bad anchor or a
page missing from mkdocs.yml's nav fails the build (mkdocs.yml's `validation` makes each of
them a warning, and --strict makes a warning fatal). mkdocs and mkdocs-material are in the
`test` extra, so a missing one is a failure here, not a skip."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _build(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                         "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict_with_every_page_and_results_json(tmp_path):
  done = _build(tmp_path, REPO / "mkdocs.yml")
  assert done.returncode == 0, done.stderr[-4000:]
  site = tmp_path / "site"
  for page in ("getting-started", "models", "sampling", "quantization", "speculative", "serving",
               "many-workers", "DEPLOY", "gpu", "performance", "ARCHITECTURE", "contributing"):
    assert (site / page / "index.html").is_file(), page
  # The performance page links each run's JSON through docs/results (-> benchmarks/results).
  results = sorted(p.name for p in (REPO / "benchmarks" / "results").glob("*.json"))
  assert results and all((site / "results" / name).is_file() for name in results)


def test_a_broken_link_fails_the_strict_build(tmp_path):
  # The same site with one page that links to a page that does not exist.
  docs = tmp_path / "docs"
  docs.mkdir()
  (docs / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
  config = tmp_path / "mkdocs.yml"
  settings = yaml.safe_load((REPO / "mkdocs.yml").read_text())
  config.write_text(yaml.safe_dump({**settings, "docs_dir": str(docs), "nav": [{"Home": "index.md"}]}))
  done = _build(tmp_path, config)
  assert done.returncode != 0
  log = done.stdout + done.stderr
  assert "contains a link 'missing.md'" in log and "Aborted with 1 warnings in strict mode" in log
