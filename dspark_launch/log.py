"""Logging: rank 0 only by default; every rank, prefixed with its rank, on request."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("dspark_launch")


def setup_logging(rank: int, all_ranks: bool = False, level: str = "INFO") -> None:
    logger.handlers.clear()
    logger.propagate = False
    if rank != 0 and not all_ranks:
        logger.setLevel(logging.ERROR)  # other ranks speak only when something breaks
    else:
        logger.setLevel(level)
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank{rank}] " if all_ranks else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(message)s"))
    logger.addHandler(handler)
