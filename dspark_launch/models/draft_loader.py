"""Load a DFlash or DSpark draft checkpoint for the live topology (this rank's slices only).

The generic `load_weights` does the reading, slicing and missing/shape errors; this module
adds what only a draft knows: its names are unprefixed, the Markov tensors carry the rank
the config must agree with, and a DSpark checkpoint's frozen embed_tokens/lm_head copies are
checked against the target and then dropped (the engine uses the target's): their shapes
always, their values when the loaded target is given (each rank compares its own vocab
shard, read lazily in row chunks).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from dspark_launch.errors import ConfigError

from .config import ModelConfig, parse_dtype
from .dflash import DFlashDraft
from .draft_config import DSPARK, DraftConfig, validate_against_target
from .dspark import DSparkDraft
from .layers.embedding import VocabParallelEmbedding
from .loader import checkpoint_files, listed, load_weights
from .qwen3 import CausalLM

# Scoped to the layer's sub-module, so DSpark's `markov_head.gate_proj` is not mistaken for
# the MLP's gate_proj.
DRAFT_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")  # DSpark's frozen target copies
COPY_CHUNK_ROWS = 4096  # rows of a copy compared at once (bounds the extra memory)
MARKOV_TENSORS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
# DeepSpec's default nn.Linear layers save these; a checkpoint without one means bias 0.
OPTIONAL_BIASES = ("markov_head.gate_proj.bias", "markov_head.joint_proj.bias")


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name -> full shape, from the headers only (no data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"{file}: unreadable safetensors file ({err})") from None
    return shapes


def check_draft_tensors(cfg: DraftConfig, target: ModelConfig,
                        shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """The checks whose message needs draft knowledge (Markov rank, target copies)."""
    r = cfg.markov_rank
    for name in MARKOV_TENSORS:
        if name not in shapes:
            if r > 0:
                raise ConfigError(f"{source}: DSpark checkpoint is missing {name!r} "
                                  f"(config.json has markov_rank={r})")
            continue
        got = shapes[name]
        if r == 0 or len(got) != 2 or got[1] != r:
            ckpt_rank = got[1] if len(got) == 2 else None
            raise ConfigError(
                f"{source}: tensor {name!r} has shape {list(got)} (Markov rank {ckpt_rank}) but "
                f"config.json has markov_rank={r} (expected [{cfg.vocab_size}, {r}])")
    want = (target.vocab_size, target.hidden_size)
    for name in TARGET_COPIES:
        if name in shapes and shapes[name] != want:
            raise ConfigError(f"{source}: draft tensor {name!r} has shape {list(shapes[name])}, "
                              f"the target's is {list(want)}")


def _drop_absent_biases(model: DFlashDraft, shapes: dict[str, tuple[int, ...]]) -> None:
    """A Markov projection whose bias the checkpoint lacks runs without one (= bias 0)."""
    params = dict(model.named_parameters())
    for name in OPTIONAL_BIASES:
        if name in params and name not in shapes:
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            layer.bias = None


def _same_values(copy: torch.Tensor, ours: torch.Tensor) -> tuple[int, float]:
    """(values that differ, max |difference|) between a draft copy and the target's rows.

    Equal means within one ulp of the coarser of the two dtypes (and below that dtype's
    smallest normal, where a cast flushes or denormalises): a frozen copy saved in bf16 of a
    target loaded as fp16/fp32 differs from the target only by that cast's rounding, while a
    different target of the same shape differs by the weights' own scale nearly everywhere.
    In the usual case (both bf16, or both fp32) this is exact equality.
    """
    copy = copy.to(ours.device)
    if copy.dtype == ours.dtype and torch.equal(copy, ours):
        return 0, 0.0  # the usual case, without fp32 temporaries
    eps = max(torch.finfo(copy.dtype).eps, torch.finfo(ours.dtype).eps)
    tiny = max(torch.finfo(copy.dtype).tiny, torch.finfo(ours.dtype).tiny)
    a, b = copy.float(), ours.float()  # [rows, d]
    diff = (a - b).abs()
    bad = diff > tiny + eps * torch.maximum(a.abs(), b.abs())
    return int(bad.sum()), float(diff.max()) if diff.numel() else 0.0


def check_target_copies(path: str | Path, target: CausalLM) -> None:
    """A DSpark draft's embed_tokens / lm_head copies must equal the loaded target's: the
    engine uses the target's, so a draft trained against another target of the same shape
    would otherwise draft from embeddings it never saw. Compares this rank's vocab shard."""
    heads: dict[str, tuple[VocabParallelEmbedding, str]] = {
        "embed_tokens.weight": (target.model.embed_tokens, "model.embed_tokens.weight"),
        "lm_head.weight": (target.lm_head, "model.embed_tokens.weight (tied lm_head)"
                           if target.config.tie_word_embeddings else "lm_head.weight"),
    }
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if key not in heads:
                    continue
                module, target_name = heads[key]
                lazy, rows = f.get_slice(key), module.owned  # this rank's ids
                bad, worst = 0, 0.0
                for lo in range(0, rows, COPY_CHUNK_ROWS):
                    hi = min(rows, lo + COPY_CHUNK_ROWS)
                    n, m = _same_values(lazy[module.start + lo:module.start + hi],
                                        module.weight.data[lo:hi])
                    bad, worst = bad + n, max(worst, m)
                if bad:
                    raise ConfigError(
                        f"{path}: DSpark draft tensor {key!r} differs from the target's "
                        f"{target_name} in {bad} of {rows * module.hidden_size} values of "
                        f"vocab rows [{module.start}, {module.start + rows}) (max |diff| "
                        f"{worst:.3g}): the draft was trained against a different target; "
                        f"pair it with the target it was trained with")


def load_draft(path: str | Path, target_config: ModelConfig,
               dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu",
               target_model: CausalLM | None = None) -> DFlashDraft | DSparkDraft:
    """Parse, check against the target, build for the live topology and load this rank's shards.

    dtype None / "auto" keeps the checkpoint's dtype. With target_model (the loaded target),
    a DSpark checkpoint's embed_tokens / lm_head copies are checked to equal the target's.
    """
    cfg = DraftConfig.from_pretrained(path)
    validate_against_target(cfg, target_config)
    source = str(path)
    shapes = checkpoint_shapes(path)
    if cfg.kind == DSPARK:
        check_draft_tensors(cfg, target_config, shapes, source)
        if target_model is not None:
            check_target_copies(path, target_model)
    model_cls = DSparkDraft if cfg.kind == DSPARK else DFlashDraft
    model = model_cls(cfg, parse_dtype(dtype, default=cfg.dtype), device)
    _drop_absent_biases(model, shapes)
    unused = load_weights(model, path, packed=DRAFT_PACKED)
    allowed = TARGET_COPIES if cfg.kind == DSPARK else ()
    extra = sorted(k for k in unused if k not in allowed and not k.endswith("inv_freq"))
    if extra:
        # A tensor we would ignore means the config and weights disagree about the
        # architecture (e.g. a gated head's gate_proj under markov_head_type="vanilla").
        raise ConfigError(f"{source}: {cfg.kind} checkpoint has {len(extra)} tensor(s) the "
                          f"config does not describe: {listed(extra)}")
    return model.eval()
