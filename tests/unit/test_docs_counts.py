"""The README's counts and the benchmark page's files stay true.

README.md states how many fields ``ElasticConfig`` has; a field added or
removed must change that sentence. Every result file committed under
``bench/results`` is cited by a document (README.md, docs/*.md,
bench/README.md): a run that no document names is history, which git keeps.
Every result file docs/benchmarks.md cites is committed there.
"""

import dataclasses
import glob
import os
import re
import subprocess

from elastic_ext.config import ElasticConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = "bench/results"
RESULT_FILE = re.compile(r"(?<![\w./<-])([\w-]+\.(?:json|png))(?![\w.-])")


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as handle:
        return handle.read()


def documents():
    """The documents that may cite a result file, as {path: text}."""
    paths = ["README.md", "bench/README.md"] + sorted(
        os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return {path: read(path) for path in paths}


def committed_results():
    """The files under bench/results that git tracks (a local run's output is not the repository's)."""
    listed = subprocess.run(["git", "ls-files", "--", RESULTS], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return sorted(os.path.basename(path) for path in listed if os.path.exists(os.path.join(REPO, path)))


def cites(text, name):
    """Whether ``text`` names ``name`` as a whole file name (``soak.json`` is not cited by ``x_soak.json``)."""
    return re.search(r"(?<![\w.-])" + re.escape(name) + r"(?![\w.-])", text) is not None


def test_the_readme_states_the_number_of_config_fields():
    stated = re.findall(r"(\d+) fields of `elastic_ext\.ElasticConfig`", read("README.md"))
    assert len(stated) == 1, f"README.md should state the field count once, found {stated}"
    fields = [field.name for field in dataclasses.fields(ElasticConfig)]
    assert int(stated[0]) == len(fields), (
        f"README.md says {stated[0]} fields of ElasticConfig; it has {len(fields)}: {fields}")


def test_every_committed_result_file_is_cited_by_a_document():
    results = committed_results()
    assert results, f"git lists no file under {RESULTS}"
    docs = documents()
    uncited = [name for name in results if not any(cites(text, name) for text in docs.values())]
    assert not uncited, (f"{RESULTS} files that no document cites (cite them in docs/benchmarks.md or "
                         f"git rm them): {uncited}")


def test_every_result_file_the_benchmark_page_cites_is_committed():
    results = set(committed_results())
    cited = set(RESULT_FILE.findall(read("docs/benchmarks.md")))
    assert cited, "docs/benchmarks.md cites no result file"
    missing = sorted(cited - results)
    assert not missing, f"docs/benchmarks.md cites result files that are not in {RESULTS}: {missing}"


def test_a_citation_is_a_whole_file_name():
    assert cites("see `soak.json`, then", "soak.json")
    assert not cites("see `soak_run2.json`", "run2.json")
    assert not cites("bench/results/x_soak.json", "soak.json")
    assert not cites("soak.json.tmp", "soak.json")
