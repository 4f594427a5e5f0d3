#!/usr/bin/env python
"""Train the tiny byte-level BPE tokenizer (2048 ids) on the stdlib train split.

Ids 0..2045 are learned BPE tokens (256 byte symbols + merges); 2046 is
<|endoftext|> (EOS/pad) and 2047 is <|MASK|> (the drafts' mask token).
Also writes split.json (the by-file train/held-out split) next to it.

    python scripts/train_tokenizer.py --out dspark_launch/assets/tiny/target
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_common as tc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(tc.ASSETS / "target"))
    ap.add_argument("--split", default=str(tc.ASSETS / "split.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.time()
    root, train, held = tc.write_split(Path(args.split), args.seed, args.heldout_frac)
    print(f"corpus {root}: {len(train)} train files, {len(held)} held-out files -> {args.split}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    n_special = 2
    trainer = trainers.BpeTrainer(
        vocab_size=tc.VOCAB_SIZE - n_special,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def it():
        for rel in train:
            yield tc.read_text(root, rel)

    tok.train_from_iterator(it(), trainer=trainer, length=len(train))
    assert tok.get_vocab_size() == tc.VOCAB_SIZE - n_special, tok.get_vocab_size()
    tok.add_special_tokens([tc.EOS_TOKEN, tc.MASK_TOKEN])
    eos, mask = tok.token_to_id(tc.EOS_TOKEN), tok.token_to_id(tc.MASK_TOKEN)
    assert (eos, mask) == (tc.VOCAB_SIZE - 2, tc.VOCAB_SIZE - 1), (eos, mask)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": tc.EOS_TOKEN,
                "pad_token": tc.EOS_TOKEN,
                "mask_token": tc.MASK_TOKEN,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "add_bos_token": False,
            },
            indent=1,
        )
        + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": tc.EOS_TOKEN, "pad_token": tc.EOS_TOKEN, "mask_token": tc.MASK_TOKEN},
            indent=1,
        )
        + "\n"
    )
    nbytes = ntok = 0
    for rel in held:
        s = tc.read_text(root, rel)
        nbytes += len(s.encode("utf-8"))
        ntok += len(tok.encode(s).ids)
    sample = "def foo(self, x):\n    return x + 1\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    print(
        f"vocab {tok.get_vocab_size()} eos={eos} mask={mask}; "
        f"held-out {nbytes / ntok:.2f} bytes/token; "
        f"{time.time() - t0:.1f}s -> {out / 'tokenizer.json'}"
    )


if __name__ == "__main__":
    main()
