"""docs/plugin-authoring.md quotes this example's files whole: the quotes must match them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "plugin-authoring.md"
INCLUDE = re.compile(r"<!-- include: (?P<path>\S+) -->\n```[a-z]*\n(?P<body>.*?)```\n", re.S)


def test_quoted_files_match_the_example() -> None:
    if not DOC.exists():
        pytest.skip("docs/plugin-authoring.md is not beside this checkout of the example")
    quotes = list(INCLUDE.finditer(DOC.read_text()))
    assert len(quotes) >= 4, "the walk-through quotes pyproject.toml, __init__.py, transport.py and spool.py"
    for q in quotes:
        path = ROOT / q["path"]
        assert path.is_file(), f"docs quote {q['path']}, which does not exist"
        assert q["body"] == path.read_text(), f"docs/plugin-authoring.md's copy of {q['path']} is out of date"
