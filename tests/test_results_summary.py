"""benchmarks/RESULTS.md: its summary tables equal what their JSON gives, its links resolve, and every raw
file kept under benchmarks/results and benchmarks/plots is cited by RESULTS.md or README.md."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from benchmarks import results_summary
from benchmarks.results_summary import BENCH_DIR, RESULTS_DIR, RESULTS_MD, main

ROOT = BENCH_DIR.parent
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:benchmarks/)?(?:results|plots)/[^`\s]+)`")


def cited_paths() -> set[Path]:
    """Every path RESULTS.md links or names in code (relative to benchmarks/), and README.md's under benchmarks/."""
    text = RESULTS_MD.read_text()
    found = {
        (BENCH_DIR / target).resolve()
        for target in LINK.findall(text) + CODE_PATH.findall(text)
        if "://" not in target and not target.startswith("#")
    }
    readme = README.read_text() if README.exists() else ""
    for target in LINK.findall(readme) + re.findall(r"`(benchmarks/[^`\s]+)`", readme):
        if target.startswith("benchmarks/"):
            found.add((ROOT / target).resolve())
    return {Path(str(path).rstrip("/")) for path in found}


def test_summary_tables_equal_what_their_json_gives() -> None:
    assert main(["--check"]) == 0


def test_check_fails_when_a_number_drifts_from_its_json(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS_DIR, results)
    results_md = tmp_path / "RESULTS.md"
    shutil.copy(RESULTS_MD, results_md)
    args = ["--check", "--results-md", str(results_md), "--results-dir", str(results)]
    assert main(args) == 0

    # A number in a JSON file changes: the tables no longer match it.
    source = next(path for path in sorted(results.rglob("*.json")) if json.loads(path.read_text()).get("summary"))
    doc = json.loads(source.read_text())
    node = doc
    *parents, leaf = doc["summary"][0]["value"].split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key = int(leaf) if isinstance(node, list) else leaf
    node[key] = float(node[key]) * 1.1 + 1.0
    source.write_text(json.dumps(doc))
    assert main(args) == 1

    # Rewriting puts the tables back in step with the JSON.
    assert main(args[1:]) == 0
    assert main(args) == 0

    # A table edited by hand is caught as well.
    text = results_md.read_text()
    begin = text.index(results_summary.BEGIN)
    cell = re.search(r"\| (\d[\d,.]*) ", text[begin:])
    assert cell is not None
    start = begin + cell.start(1)
    results_md.write_text(text[:start] + "9" + text[start:])
    assert main(args) == 1


def test_every_path_results_md_links_exists() -> None:
    text = RESULTS_MD.read_text()
    targets = [t for t in LINK.findall(text) + CODE_PATH.findall(text) if "://" not in t and not t.startswith("#")]
    assert targets
    missing = [t for t in targets if not (BENCH_DIR / t).exists()]
    assert not missing, f"RESULTS.md links paths that do not exist: {missing}"


def test_every_kept_raw_file_is_cited() -> None:
    cited = cited_paths()
    uncited = []
    for top in (BENCH_DIR / "results", BENCH_DIR / "plots"):
        for path in sorted(p for p in top.rglob("*") if p.is_file()):
            chain = [path.resolve(), *path.resolve().parents]
            if not any(p in cited for p in chain[: len(chain) - len(top.resolve().parents)]):
                uncited.append(path.relative_to(BENCH_DIR).as_posix())
    assert not uncited, f"files under benchmarks/results or plots that RESULTS.md and README.md do not cite: {uncited}"


def test_results_name_no_work_periods() -> None:
    text = RESULTS_MD.read_text()
    assert not re.search(r"\bsessions?\b", text, re.IGNORECASE)
    assert not re.search(r"\bcalls? \d", text)
    names = [p.relative_to(BENCH_DIR).as_posix() for top in ("results", "plots") for p in (BENCH_DIR / top).rglob("*")]
    assert not [n for n in names if re.search(r"session|call\d", n, re.IGNORECASE)]
