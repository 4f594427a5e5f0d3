"""Load HF safetensors checkpoints into parameters that know their own shard.

`load_weights` is model-agnostic: it maps each checkpoint name to a parameter (fused
parameters via the module's `packed_modules`), hands the parameter's `weight_loader` a
lazy safetensors slice so each rank reads only the rows/columns it owns, and then checks
that every parameter (and every fused sub-matrix) was filled. Every way a checkpoint can be
broken ends in one ConfigError that names the file or tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dspark_launch.errors import ConfigError
from dspark_launch.log import logger
from dspark_launch.parallel import get_parallel

from .config import ModelConfig, parse_dtype
from .layers.weights import ShapeMismatch, default_weight_loader
from .qwen3 import CausalLM

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, each checked to exist and not be truncated."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"{index}: unreadable safetensors index ({err!r})") from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{path}: no *.safetensors weights found")
    for file in files:
        if not file.is_file():
            raise ConfigError(f"{file}: safetensors file listed in {INDEX_FILE} is missing")
        _check_not_truncated(file)
    return files


def _check_not_truncated(file: Path) -> None:
    """Compare the header's data extent with the file size (an mmap past EOF would SIGBUS)."""
    size = file.stat().st_size
    try:
        with file.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if 8 + header_len > size:
                raise ValueError("header runs past the end of the file")
            header = json.loads(fh.read(header_len))
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{file}: truncated or corrupt safetensors file ({err})") from None
    if 8 + header_len + end > size:
        raise ConfigError(f"{file}: truncated safetensors file: {size} bytes on disk, "
                          f"the header describes {8 + header_len + end}")


def _param_name(key: str, packed: Mapping[str, tuple[str, object]]) -> tuple[str, object]:
    for ckpt_sub, (param_sub, shard) in packed.items():
        if f".{ckpt_sub}." in f".{key}":
            return key.replace(ckpt_sub, param_sub, 1), shard
    return key, None


def _expected(names: Iterable[str], packed: Mapping[str, tuple[str, object]]
              ) -> dict[tuple[str, object], str]:
    """(parameter name, shard id) -> the checkpoint tensor name that must fill it."""
    out: dict[tuple[str, object], str] = {}
    for name in names:
        subs = [(c, p, s) for c, (p, s) in packed.items() if f".{p}." in f".{name}"]
        if not subs:
            out[(name, None)] = name
        for ckpt_sub, param_sub, shard in subs:
            out[(name, shard)] = name.replace(param_sub, ckpt_sub, 1)
    return out


def load_weights(module: nn.Module, path: str | Path,
                 packed: Mapping[str, tuple[str, object]] | None = None,
                 rename: Mapping[str, str] | None = None) -> list[str]:
    """Fill every parameter of `module` from the checkpoint at `path`.

    packed: checkpoint sub-name -> (parameter sub-name, shard id); defaults to
    `module.packed_modules`. rename: checkpoint-name prefix -> parameter-name prefix (for
    draft formats whose names lack a prefix). Returns the checkpoint tensors nothing used
    (e.g. a draft's frozen copy of the target embedding); a missing tensor is an error.
    """
    packed = packed if packed is not None else getattr(module, "packed_modules", {})
    params = dict(module.named_parameters())  # tied parameters appear once
    todo = _expected(params, packed)
    unused: list[str] = []
    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"{file}: unreadable safetensors file ({err})") from None
        with handle as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                name = key
                for old, new in (rename or {}).items():
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                name, shard = _param_name(name, packed)
                if name not in params:
                    unused.append(key)
                    continue
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    if shard is None:
                        loader(param, f.get_slice(key))
                    else:
                        loader(param, f.get_slice(key), shard)
                except ShapeMismatch as err:
                    raise ConfigError(
                        f"{file.name}: tensor {key!r} has shape {list(err.got)}, the model "
                        f"expects {list(err.expected)}") from None
                todo.pop((name, shard), None)
    if todo:
        names = sorted(todo.values())
        raise ConfigError(f"{path}: checkpoint is missing {len(names)} tensor(s): "
                          f"{listed(names)}")
    return unused


def listed(names: list[str], limit: int = 8) -> str:
    """The first `limit` tensor names for a message, quoted, then "..." if there are more."""
    return ", ".join(repr(n) for n in names[:limit]) + (" ..." if len(names) > limit else "")


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: torch.device | str = "cpu") -> CausalLM:
    """Build the target for the live topology and load this rank's shards.

    dtype: None or "auto" keeps the checkpoint's dtype; otherwise overrides it (--dtype).
    """
    config = ModelConfig.from_pretrained(path)
    p = get_parallel()
    config.check_topology(p.tp_size, p.attn_tp_size)
    model = CausalLM(config, parse_dtype(dtype, default=config.dtype), device)
    unused = load_weights(model, path)
    # Tensors the config leaves out (a Llama's q/k/v biases without attention_bias) are
    # ignored, as transformers ignores them, and named, as it names them; a tied model's
    # lm_head copy and old rotary tables are expected.
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    if extra := sorted(k for k in unused if k not in tied and not k.endswith("inv_freq")):
        logger.warning("%s: %d checkpoint tensor(s) the config does not describe were not "
                       "loaded: %s", path, len(extra), listed(extra))
    return model.eval()
