"""dspark-launch: speculative decoding (DFlash / DSpark block drafters) under torchrun.

`from dspark_launch import LLM, SamplingParams` is the in-process API (dspark_launch/api.py);
it is imported on first use, so `python -m dspark_launch` does not pay for it.
"""

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "NotSPMD"]


def __getattr__(name: str):
    if name in __all__:
        from dspark_launch import api

        return getattr(api, name)
    raise AttributeError(f"module 'dspark_launch' has no attribute {name!r}")
