"""helpers/show.py: Markdown tables whose cells may hold a `|`, and the check that finds a ragged row."""

import pytest

from helpers.show import cell, markdown_table, ragged_rows


def test_a_bar_in_a_cell_is_escaped_and_the_row_keeps_its_width():
    table = markdown_table(["what", "value"], [["||ΔW|| / ||W||", 1], ["`a|b`", "x\ny"]])
    assert ragged_rows(table) == []
    assert r"| \|\|ΔW\|\| / \|\|W\|\| | 1 |" in table
    assert "| x y |" in table
    assert cell(r"already \| escaped") == r"already \| escaped"


def test_the_unescaped_table_is_found_ragged():
    """What the table looked like before the escape: the check must see it."""
    bad = "| what | value |\n|---|---|\n| ||ΔW|| / ||W|| | 1 |\n| ok | 2 |\n"
    found = ragged_rows(bad)
    assert len(found) == 1 and "10 cells where its header has 2" in found[0], found


def test_tables_in_code_fences_and_narrow_rows():
    fenced = "```\n| a | b |\n|---|---|\n| 1 | 2 | 3 |\n```\n"
    assert ragged_rows(fenced) == []
    short = "text\n\n| a | b | c |\n|:--|--:|---|\n| 1 | 2 |\n\nafter | bar\n"
    assert ragged_rows(short) == ["2 cells where its header has 3: '| 1 | 2 |'"]


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="header's 2 cells"):
        markdown_table(["a", "b"], [[1, 2], [1]])
