"""The data beside the checkout (`../shared/data`: MATH-500, AIME 2024, the published configs).

It is not part of the repository: a clone of it alone has no such folder, and the tests that
need it skip, each saying what is missing. CI has it and sets RKVJAX_REQUIRE_SHARED_DATA=1
(`.ci/run`), so there a missing file fails those tests instead of skipping them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REQUIRE = "RKVJAX_REQUIRE_SHARED_DATA"


def need(*parts: str) -> Path:
    """SHARED_DATA/parts, or skip the test (fail it where REQUIRE is set) when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if path.exists():
        return path
    what = f"{path} is missing (the evaluation data and published configs kept beside the "
    what += "checkout, not in the repository)"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{what}, and {REQUIRE}=1 says this run must have it")
    pytest.skip(what)
