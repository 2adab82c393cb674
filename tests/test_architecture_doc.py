"""docs/architecture.md agrees with the code: its layer table, module table and figure fingerprint are what
``docs/make_architecture.py`` generates from the package's imports now, and the files its prose names exist.

Runs the script's ``--check`` (ast only: nothing is drawn, nothing of the package is imported).
"""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("_make_architecture", ROOT / "docs" / "make_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_page_matches_the_code():
    script = _script()
    problems = script.check(script.Graph())
    assert not problems, "\n".join(problems) + "\nrerun: python docs/make_architecture.py"


def test_first_sentence_of_a_docstring():
    first = _script().first_sentence
    assert first("Moves ``x``, e.g. a leaf. Then more.") == "Moves `x`, e.g. a leaf."
    assert first("Over :class:`~vescale_jax.ShardedParams` (see :mod:`vescale_jax.optim`). More.") == (
        "Over `ShardedParams` (see `vescale_jax.optim`)."
    )
    assert first("A | B ``a.b`` c") == "A \\| B `a.b` c"
    assert first("Checks:\n\nmore") == "Checks"
    assert first(None) == "(no module docstring)"
