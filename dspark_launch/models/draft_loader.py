"""Load a DFlash or DSpark draft checkpoint for the live topology (this rank's slices only).

The generic `load_weights` does the reading, slicing and missing/shape errors; this module
adds what only a draft knows: its names are unprefixed, the Markov tensors carry the rank
the config must agree with, and a DSpark checkpoint's frozen embed_tokens/lm_head copies are
shape-checked against the target and then dropped (the engine uses the target's).
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
from .loader import checkpoint_files, load_weights

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


def load_draft(path: str | Path, target_config: ModelConfig,
               dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu"
               ) -> DFlashDraft | DSparkDraft:
    """Parse, check against the target, build for the live topology and load this rank's shards.

    dtype None / "auto" keeps the checkpoint's dtype.
    """
    cfg = DraftConfig.from_pretrained(path)
    validate_against_target(cfg, target_config)
    source = str(path)
    shapes = checkpoint_shapes(path)
    if cfg.kind == DSPARK:
        check_draft_tensors(cfg, target_config, shapes, source)
    model_cls = DSparkDraft if cfg.kind == DSPARK else DFlashDraft
    model = model_cls(cfg, parse_dtype(dtype, default=cfg.dtype), device)
    _drop_absent_biases(model, shapes)
    unused = load_weights(model, path, packed=DRAFT_PACKED)
    allowed = TARGET_COPIES if cfg.kind == DSPARK else ()
    extra = sorted(k for k in unused if k not in allowed and not k.endswith("inv_freq"))
    if extra:
        # A tensor we would ignore means the config and weights disagree about the
        # architecture (e.g. a gated head's gate_proj under markov_head_type="vanilla").
        shown = ", ".join(repr(k) for k in extra[:8]) + (" ..." if len(extra) > 8 else "")
        raise ConfigError(f"{source}: {cfg.kind} checkpoint has {len(extra)} tensor(s) the "
                          f"config does not describe: {shown}")
    return model.eval()
