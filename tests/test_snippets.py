"""The Python snippets of the README and the docs run as shown (``docs/check_snippets.py``), one page per test."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("check_snippets", ROOT / "docs" / "check_snippets.py")
check_snippets = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check_snippets)


@pytest.mark.parametrize("page", check_snippets.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run_as_shown(page, capsys):
    failures = check_snippets.check(page)
    assert failures == 0, capsys.readouterr().out
