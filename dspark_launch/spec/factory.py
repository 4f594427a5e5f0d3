"""Choose and build the proposer for --speculative-algorithm."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dspark_launch.errors import ConfigError
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.spec.proposer import Proposer

NGRAM_BLOCK = 8


def draft_kind_of(path: str | None) -> str:
    from dspark_launch.models.draft_config import detect_draft_kind

    cfg = Path(str(path)) / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"--draft={path}: no config.json there")
    try:
        return detect_draft_kind(json.loads(cfg.read_text()), f"--draft={path}: {cfg}")
    except json.JSONDecodeError as err:
        raise ConfigError(f"{cfg}: not valid JSON ({err.msg})") from None


@dataclass
class ProposerParts:
    """A proposer's pieces known before the KV pools exist (they size the draft pool)."""

    algorithm: str
    block_size: int
    draft: object | None
    target: object
    confidence_threshold: float = 0.0
    ngram_max: int = 3

    @property
    def geometry(self) -> KVGeometry | None:
        if self.draft is None:
            return None
        c = self.draft.config
        return KVGeometry("draft", c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                          c.head_dim, self.draft.dtype)

    @property
    def max_drafts(self) -> int:
        return self.build_stub().max_drafts

    @property
    def block_rows(self) -> int:
        return self.build_stub().block_rows

    def build_stub(self) -> Proposer:
        return self.build(None, None)

    def build(self, memory, backend) -> Proposer:
        from dspark_launch.spec.block_drafter import DFlashProposer, DSparkProposer
        from dspark_launch.spec.ngram import NgramProposer

        if self.algorithm == "NONE":
            return Proposer()
        if self.algorithm == "NGRAM":
            return NgramProposer(self.block_size, self.ngram_max)
        space = memory.space if memory is not None else None
        pool = memory.draft if memory is not None else None
        args = (self.draft, self.target, space, pool, backend, self.block_size)
        if self.algorithm == "DFLASH":
            return DFlashProposer(*args)
        return DSparkProposer(*args, confidence_threshold=self.confidence_threshold)


def make_proposer(cfg, algorithm: str, draft_path: str | None, target, device,
                  dtype: str) -> ProposerParts:
    draft = None
    block = cfg.block_size or NGRAM_BLOCK
    if algorithm in ("DFLASH", "DSPARK"):
        from dspark_launch.models.draft_loader import load_draft

        draft = load_draft(draft_path, target.config, dtype, device, target_model=target)
        block = cfg.block_size or draft.config.block_size
    if algorithm == "DFLASH" and block < 2:
        raise ConfigError(f"--block-size={block}: DFLASH needs >= 2 (slot 0 is the anchor)")
    return ProposerParts(algorithm, block, draft, target, cfg.dspark_confidence_threshold,
                         cfg.ngram_max)
