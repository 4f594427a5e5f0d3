"""Target models (Qwen3/Llama), their TP/DP-attention layers and the checkpoint loader."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .loader import load_model, load_weights
from .qwen3 import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelConfig", "load_model", "load_weights"]
