"""Writes docs/cli.md from the `--help` of `baton`, each of its subcommands and the server modules.

Run `.venv/bin/python docs/gen_cli.py` to rewrite docs/cli.md, `--check` to exit 1 when it is stale
(`tests/test_cli_docs.py` does that).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# argparse wraps to the terminal's width and may colour its output: fix both so the text is the same everywhere.
COLUMNS = "100"
os.environ["COLUMNS"] = COLUMNS
os.environ["NO_COLOR"] = "1"
os.environ["PYTHON_COLORS"] = "0"

DOC = Path(__file__).resolve().parent / "cli.md"

HEADER = """# Command-line reference

Generated from each command's `--help` by `docs/gen_cli.py`; do not edit by hand. After changing a flag,
run `.venv/bin/python docs/gen_cli.py` (`tests/test_cli_docs.py` fails while this file is stale).

"""


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser, then every subcommand's parser below it, depth first in declaration order."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:  # aliases map several names to one parser
                    seen.add(id(sub))
                    yield from _subparsers(sub)


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(section title, parser) for every command documented."""
    from baton.cli.main import build_parser
    from baton.decode_node.server import parser as decode_parser
    from baton.prefill_node.server import parser as prefill_parser
    from baton.router.server import _parser as router_parser

    out = [(p.prog, p) for p in _subparsers(build_parser())]
    out.append(("python -m baton.router.server", router_parser()))
    out.append(("python -m baton.prefill_node.server", prefill_parser()))
    out.append(("python -m baton.decode_node.server", decode_parser()))
    return out


def render() -> str:
    sections = [HEADER.rstrip("\n")]
    index = [f"- [`{title}`](#{_anchor(title)})" for title, _ in parsers()]
    sections.append("\n".join(index))
    for title, p in parsers():
        sections.append(f"## `{title}`\n\n```\n{p.format_help().rstrip()}\n```")
    return "\n\n".join(sections) + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md differs from the --help texts")
    a = ap.parse_args(argv)
    text = render()
    if not a.check:
        DOC.write_text(text)
        return 0
    old = DOC.read_text() if DOC.exists() else ""
    if old == text:
        return 0
    sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), "docs/cli.md",
                                               "--help texts"))
    print("docs/cli.md is stale: run .venv/bin/python docs/gen_cli.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
