"""The one Markdown table writer (nobubble.markdown) that every command's tables go through."""

import ast
from pathlib import Path

import pytest

import nobubble
from nobubble.markdown import markdown_table


def test_a_table_has_its_header_rule_and_rows_with_numbers_right_aligned():
    table = markdown_table(["name", "value"], [["a", "1"], ["b", "22"]], align="lr")
    assert table.splitlines() == ["| name | value |", "|---|---:|", "| a | 1 |", "| b | 22 |"]
    assert markdown_table(["x"], []).splitlines() == ["| x |", "|---|"]  # left by default


@pytest.mark.parametrize("align", ["l", "lrr", "lx"])
def test_an_alignment_that_does_not_fit_the_columns_is_refused(align):
    with pytest.raises(ValueError, match="one of l or r for each of 2 columns"):
        markdown_table(["a", "b"], [], align=align)


def test_no_module_builds_a_markdown_table_by_hand():
    """A table's rule row (``|---``) is written only by the table writer."""
    package = Path(nobubble.__file__).parent
    by_hand = []
    for path in package.rglob("*.py"):
        if path.name == "markdown.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and "|---" in str(node.value):
                by_hand.append(f"{path.relative_to(package)}:{node.lineno}")
    assert by_hand == []
