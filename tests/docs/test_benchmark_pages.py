"""docs/benchmarks.md is a summary whose every figure names its baseline and range, and nothing it points to is lost.

The dated run logs live in docs/benchmarks-history.md; the summary links each headline figure to its section there.
A moved or renamed heading, a JSON report that no page names any more, or a headline row without a baseline or a
range would each leave a claim its reader cannot check. Links are checked in README.md and every page under docs/
(a link into a heading that does not exist fails); the anchor rule is GitHub's, checked against headings taken from
the pages themselves. Negative controls: a made-up anchor, a made-up results file and a row with an empty range
are caught by the same functions the tests use.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SUMMARY = DOCS / "benchmarks.md"
HISTORY = DOCS / "benchmarks-history.md"
RESULTS = DOCS / "results"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT_PATH = re.compile(r"docs/results/[\w./*-]*\w")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `#` there is a comment, a `[x](y)` is code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text(encoding="utf-8")), flags=re.M)}


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Relative links of `page` whose file is missing or whose `#anchor` names no heading of the target page."""
    text = _prose(page.read_text(encoding="utf-8") if text is None else text)
    broken = []
    for url in LINK.findall(text):
        if re.match(r"[a-z]+:", url):  # http:, https:, mailto:
            continue
        path, _, fragment = url.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists() or (fragment and target.suffix == ".md" and fragment not in anchors(target)):
            broken.append(url)
    return broken


def missing_results(text: str) -> list[str]:
    """`docs/results/...` paths (globs allowed) named in `text` that match no file."""
    return [p for p in RESULT_PATH.findall(text) if not any(ROOT.glob(p))]


def headline_rows(text: str) -> list[list[str]]:
    """Cells of the first table's rows, header and group rows (only the first cell filled) left out."""
    table = re.search(r"^(\|.*\|\n)+", text, flags=re.M)
    assert table, "no table"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.group(0).splitlines()[2:]]
    return [r for r in rows if any(r[1:])]


def test_slug_matches_github_on_this_pages_headings():
    assert slug("CPU ops in C++, and a profiling artifact (2026-12-04, evening)") == (
        "cpu-ops-in-c-and-a-profiling-artifact-2026-12-04-evening"
    )
    assert slug("Quickstart: `make run` on 2 CPU cores (2026-11-29)") == "quickstart-make-run-on-2-cpu-cores-2026-11-29"
    assert slug("Notebook decode: astrai.generate reuses") == "notebook-decode-astraigenerate-reuses"


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = {page.relative_to(ROOT).as_posix(): b for page in PAGES if (b := broken_links(page))}
    assert not broken, f"links to missing files or headings: {broken}"
    # negative controls: a heading that does not exist, a file that does not exist
    made_up = "benchmarks-history.md#no-such-section"
    assert broken_links(SUMMARY, f"[x]({made_up})") == [made_up]
    assert broken_links(SUMMARY, "[x](no-such-page.md)") == ["no-such-page.md"]


def test_every_results_file_named_in_the_docs_exists_and_every_report_is_named():
    named = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        missing = missing_results(text)
        assert not missing, f"{page.name} names {missing}, which docs/results/ does not hold"
        named |= {m for p in RESULT_PATH.findall(text) for m in ROOT.glob(p)}
    pages = SUMMARY.read_text(encoding="utf-8") + HISTORY.read_text(encoding="utf-8")
    linked = {RESULTS / Path(u).name for u in LINK.findall(pages) if u.startswith("results/")}
    unnamed = sorted(p.name for p in RESULTS.iterdir() if p not in named | linked and not p.is_dir())
    assert not unnamed, f"docs/results/ holds reports no page names in full (a figure without its JSON): {unnamed}"
    assert missing_results("docs/results/cpu_bench_made_up.json") == ["docs/results/cpu_bench_made_up.json"]


def test_the_summary_is_a_table_of_figures_with_baseline_and_range_then_no_run_logs():
    text = SUMMARY.read_text(encoding="utf-8")
    header = re.search(r"^\|.*\|$", text, flags=re.M).group(0)
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[:6] == ["figure", "astrai", "baseline (its path)", "ratio", "range over runs", "date, machine"]
    rows = headline_rows(text)
    assert len(rows) >= 20, "the headline table lost its rows"
    empty = [r[0][:60] for r in rows if len(r) != 6 or not r[2] or not r[4] or not r[5]]
    assert not empty, f"headline rows without a baseline, a range (or '1 run') or a date and machine: {empty}"
    assert all("benchmarks-history.md#" in r[0] for r in rows), "each headline figure links to its run log"
    # negative control: a row whose range cell is empty is read as empty
    bad = f"{header}\n|---|---|---|---|---|---|\n| [x](benchmarks-history.md#x) | 1 | 2 | 0.5× |  | today |\n"
    assert [r[4] for r in headline_rows(bad)] == [""]
    # the dated logs are on the history page, and every one of its sections is listed in the summary
    assert not re.findall(r"^##+ .*\(20\d\d-", text, flags=re.M), "a dated run log on the summary page"
    sections = re.findall(r"^## (.+)$", _prose(HISTORY.read_text(encoding="utf-8")), flags=re.M)
    assert len(sections) >= 30
    unlisted = [s for s in sections if f"(benchmarks-history.md#{slug(s)})" not in text]
    assert not unlisted, f"run logs the summary does not list: {unlisted}"
