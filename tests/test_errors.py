"""first_line: error messages shortened without ever failing themselves."""

from __future__ import annotations

from torchtame.errors import first_line


def test_first_line_of_exceptions_and_strings() -> None:
    assert first_line(RuntimeError("boom\nstack detail")) == "boom"
    assert first_line(RuntimeError()) == "RuntimeError"  # empty messages name the type
    assert first_line(ValueError("   ")) == "ValueError"
    assert first_line(None) == "" and first_line("") == ""
    assert first_line("x" * 50, 10) == "x" * 10
