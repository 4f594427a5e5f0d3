"""Rank 0 speaks by default; --log-all-ranks makes every rank speak, prefixed with its rank."""

from __future__ import annotations

import logging

import pytest

from dspark_launch.log import logger, setup_logging


@pytest.mark.parametrize(
    "rank,all_ranks,expect",
    [(0, False, "INFO hello"), (3, False, None), (3, True, "[rank3] INFO hello")],
)
def test_rank_filtering_and_prefix(rank, all_ranks, expect, capsys) -> None:
    setup_logging(rank, all_ranks)
    logger.info("hello")
    logger.error("boom")  # errors always reach the user, from any rank
    lines = capsys.readouterr().err.splitlines()
    assert (expect in lines) if expect else not any("hello" in line for line in lines)
    assert any(line.endswith("ERROR boom") for line in lines)
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
