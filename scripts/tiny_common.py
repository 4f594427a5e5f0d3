"""Shared helpers for the tiny embedded model family (tokenizer, target, drafts).

Used only by scripts/train_tokenizer.py, scripts/train_target.py and
scripts/train_drafts.py.  Everything here is deterministic given a seed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "dspark_launch" / "assets" / "tiny"

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
VOCAB_SIZE = 2048

_TEST_PARTS = {"test", "tests", "idle_test"}


def stdlib_files() -> list[Path]:
    """All stdlib .py files, excluding test directories and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        parts = set(rel.parts[:-1])
        if parts & _TEST_PARTS or "site-packages" in rel.parts:
            continue
        if rel.parts[0].startswith("test") or rel.name.startswith("test_"):
            continue
        out.append(p)
    return out


def split_files(seed: int = 0, heldout_frac: float = 0.05):
    """Split stdlib files by file into (train, heldout), deterministic in `seed`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rels = [str(p.relative_to(root)) for p in files]
    rng = random.Random(seed)
    order = list(range(len(rels)))
    rng.shuffle(order)
    n_held = max(1, int(round(len(rels) * heldout_frac)))
    held = sorted(rels[i] for i in order[:n_held])
    train = sorted(rels[i] for i in order[n_held:])
    return root, train, held


def read_text(root: Path, rel: str) -> str:
    try:
        return (root / rel).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return (root / rel).read_text(encoding="latin-1")


def write_split(path: Path, seed: int, heldout_frac: float):
    root, train, held = split_files(seed, heldout_frac)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "corpus": "CPython stdlib .py files (test dirs excluded)",
                "python": sysconfig.get_python_version(),
                "seed": seed,
                "heldout_frac": heldout_frac,
                "n_train": len(train),
                "n_heldout": len(held),
                "heldout": held,
            },
            indent=1,
        )
        + "\n"
    )
    return root, train, held


def load_split(path: Path):
    d = json.loads(Path(path).read_text())
    root, train, held = split_files(d["seed"], d["heldout_frac"])
    if held != d["heldout"]:
        # stdlib differs from the recorded one: trust the recorded held-out list.
        held_set = set(d["heldout"])
        files = [str(p.relative_to(root)) for p in stdlib_files()]
        held = [f for f in files if f in held_set]
        train = [f for f in files if f not in held_set]
    return root, train, held


def encode_files(tok, root: Path, rels: list[str]):
    """Tokenize files, returning one flat list with EOS between documents."""
    import torch

    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    texts = [read_text(root, r) for r in rels]
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def set_threads(n: int = 1):
    import torch

    os.environ.setdefault("RAYON_NUM_THREADS", str(n))
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int):
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def cosine_lr(frac: float, peak: float, warm: float = 0.03, floor: float = 0.1) -> float:
    if frac < warm:
        return peak * frac / warm
    f = min(1.0, (frac - warm) / max(1e-9, 1 - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * f)))


def count_params(sd) -> int:
    return sum(v.numel() for v in sd.values())
