"""Fixtures of the runtime tests: one pool of gloo worker processes for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.runtime.pool import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    pool = RankPool(4)
    try:
        yield pool
    finally:
        pool.close()
