"""docs/cli.md against the `--help` texts, and README.md's links against the files and headings they name."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation but '-' and '_' dropped, spaces to
    '-', and '-1', '-2', ... on repeats."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_code or not m:
            continue
        base = "".join(c for c in m.group(1).lower() if c.isalnum() or c in " -_").replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_cli_md_matches_help(monkeypatch, capsys):
    # A fixed width makes argparse's wrapping the same on every terminal and machine (gen_cli.py sets these too,
    # when imported: monkeypatch gives the other tests their environment back).
    for name, value in (("COLUMNS", "100"), ("NO_COLOR", "1"), ("PYTHON_COLORS", "0")):
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    code = gen_cli.main(["--check"])
    out, err = capsys.readouterr()
    assert code == 0, out[-4000:] + err


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    anchors_of: dict[Path, set[str]] = {}
    for target in LINK.findall(readme):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        assert file.exists(), f"README.md links to {path}, which does not exist"
        if anchor and file.suffix == ".md":
            anchors = anchors_of.setdefault(file, github_anchors(file.read_text()))
            assert anchor in anchors, f"README.md links to {target}: no such heading in {path or 'README.md'}"


def test_readme_links_into_results():
    # The performance table's numbers each point at the RESULTS.md section that holds the measurement.
    assert "benchmarks/RESULTS.md#" in (ROOT / "README.md").read_text()


def test_readme_is_short_and_names_no_work_periods():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    assert not re.search(r"\bsessions?\s+\d", readme, re.IGNORECASE)
