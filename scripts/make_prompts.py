"""Write the built-in prompt set: code windows from the embedded model's held-out stdlib files.

    python scripts/make_prompts.py [--count 32] [--chars 240] [--seed 0]

The held-out file list is dspark_launch/assets/tiny/split.json (written by train_tokenizer.py),
so these prompts were never trained on.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPLIT = ROOT / "dspark_launch" / "assets" / "tiny" / "split.json"
OUT = ROOT / "dspark_launch" / "assets" / "prompts" / "heldout.jsonl"


def windows(text: str, chars: int, rng: random.Random) -> str | None:
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class ", "    def "))]
    if not starts:
        return None
    i = rng.choice(starts)
    window = ""
    for line in lines[i:]:
        if len(window) + len(line) > chars:
            break
        window += line
    return window or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--chars", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = json.loads(SPLIT.read_text())["heldout"]
    prompts: list[str] = []
    while len(prompts) < args.count:
        name = rng.choice(files)
        path = stdlib / name
        if not path.is_file():
            continue
        w = windows(path.read_text(encoding="utf-8", errors="replace"), args.chars, rng)
        if w and w not in prompts:
            prompts.append(w)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"heldout-{i}", "prompt": p}) + "\n")
    print(f"wrote {len(prompts)} prompts to {OUT}")


if __name__ == "__main__":
    main()
