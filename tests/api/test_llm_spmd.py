"""LLM() and generate() are SPMD: every rank calls them with the same arguments. What a user's
program that breaks the rule gets, on a real 2-rank gloo world that the engine makes itself
(torchrun's environment, no process group of the program's own).

Oracles: the same call made right on every rank (its greedy tokens), and the arguments each
rank was given (the message must name what differs, and on which ranks).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
from multirank import run_world
from references import heldout
from safetensors.torch import load_file, save_file

from dspark_launch.engine.build import ASSETS

ARGS = {"kv_cache_memory": "64MiB", "device": "cpu", "speculative_policy": "fixed"}


def _misuse(rank: int, tmp: str) -> dict:
    import gc
    import time

    from dspark_launch import LLM, NotSPMD, SamplingParams
    from dspark_launch.parallel import get_parallel

    prompts = heldout()[:2]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    out: dict = {"said": {}}

    def refused(name: str, call) -> None:
        try:
            call()
        except NotSPMD as err:
            out["said"][name] = str(err)

    llm = LLM(dist_timeout=20, **ARGS)
    out["right"] = llm.generate(prompts[0], greedy)[0].token_ids
    refused("prompt", lambda: llm.generate(prompts[rank], greedy))
    refused("count", lambda: llm.generate(prompts[:rank + 1], greedy))
    refused("params", lambda: llm.generate(
        prompts[0], SamplingParams(max_tokens=8 - 4 * rank, temperature=0)))
    refused("bad on one", lambda: llm.generate(prompts[0] if rank else [10**9], greedy))
    out["after"] = llm.generate(prompts[0], greedy)[0].token_ids  # still in step
    # Stops are a set: listed in other orders (a set's order differs per process) they agree.
    stops = ["e", " ", "a", "\n"]
    out["stops"] = llm.generate(prompts[0], SamplingParams(
        max_tokens=8, temperature=0, stop=stops[::1 - 2 * rank]))[0].text
    llm.shutdown()
    if rank == 0:
        time.sleep(1.0)  # the next runtime's rendezvous with the ranks a second apart
    refused("LLM()", lambda: LLM(dist_timeout=20, block_size=4 + rank, **ARGS))
    llm = LLM(dist_timeout=20, **ARGS)
    out["second"] = llm.generate(prompts[0], greedy)[0].token_ids
    del llm  # dropped without shutdown()
    gc.collect()
    llm = LLM(dist_timeout=20, attn_dp_size=2, **ARGS)
    out["attn_dp"] = get_parallel().attn_dp_size
    out["dp"] = llm.generate(prompts[0], greedy)[0].token_ids
    llm.shutdown()
    with LLM(dist_timeout=3, **ARGS) as llm:
        t0 = time.monotonic()
        if rank == 0:  # only rank 0 calls generate(): the most common mistake
            refused("only rank 0", lambda: llm.generate(prompts[0], greedy))
        else:
            time.sleep(5)
            refused("late", lambda: llm.generate(prompts[0], greedy))
        out["waited"] = time.monotonic() - t0
        try:
            llm.generate(prompts[0], greedy)
        except RuntimeError as err:
            out["after late"] = str(err)
    # One rank's arguments refused before it could join (a bad value: it still checks in
    # with its refusal, so its peer need not wait dist_timeout for it), then one refused
    # after (EngineArgs: chunked_prefill_size=0), then the right call.
    t0 = time.monotonic()
    refused("refused before joining", lambda: LLM(dist_timeout=60, tp_size=0 if rank else None,
                                                  **ARGS))
    refused("memory refused before joining", lambda: LLM(
        dist_timeout=60, **{**ARGS, "kv_cache_memory": "lots" if rank else "64MiB"}))
    out["refused in"] = time.monotonic() - t0
    refused("one rank refused", lambda: LLM(dist_timeout=20, chunked_prefill_size=1 - rank,
                                            **ARGS))
    # Nodes may hold one checkpoint at different paths: the ranks compare what it holds (a
    # file the engine does not read, on one rank only, changes nothing).
    copies = {}
    for name in ("target", "dspark"):
        copies[name] = Path(tmp) / f"rank{rank}" / name
        copies[name].mkdir(parents=True)
        for f in (ASSETS / name).iterdir():
            (copies[name] / f.name).symlink_to(f)
    if rank == 1:
        (copies["target"] / "trainer_state.json").write_text("{}")
    with LLM(str(copies["target"]), Path(copies["dspark"]), dist_timeout=20, **ARGS) as llm:
        out["retried"] = llm.generate(prompts[0], greedy)[0].token_ids
    # ... and a copy that holds other weights of the same shapes (another training step's,
    # which trained one small tensor: the same config, names, sizes and header) is another
    # checkpoint.
    if rank == 1:
        weights = copies["target"] / "model.safetensors"
        tensors = load_file(weights)
        weights.unlink()
        save_file({k: v * 1.01 if k == "model.norm.weight" else v for k, v in tensors.items()},
                  weights, metadata={"format": "pt"})
        with open(weights, "rb") as new, open(ASSETS / "target/model.safetensors", "rb") as old:
            assert new.read(16 << 10) == old.read(16 << 10)  # the header and more
    refused("other weights", lambda: LLM(str(copies["target"]), str(copies["dspark"]),
                                         dist_timeout=20, **ARGS))
    # Last (the ranks' runtime counts part here): a rank refusing an argument alone keeps
    # the dist_timeout it was given for its check-in, not the default 300 s.
    if rank == 1:
        t0 = time.monotonic()
        refused("alone", lambda: LLM(dist_timeout=2, tp_size=0, **ARGS))
        out["alone in"] = time.monotonic() - t0
    return out


def test_ranks_asked_different_things_are_named_and_stay_in_step(tmp_path):
    results = run_world(2, _misuse, str(tmp_path), timeout=240)
    for r in results:
        assert r["after"] == r["second"] == r["dp"] == r["right"]
        assert r["attn_dp"] == 2  # not the dropped LLM's topology
    r0, r1 = results
    assert r0["right"] == r1["right"]
    assert r0["stops"] == r1["stops"]
    for name in ("prompt", "count", "params", "bad on one", "LLM()"):
        assert r0["said"][name] == r1["said"][name], name  # every rank says the same
    said = r0["said"]
    assert said["prompt"].startswith("generate() call 2 differs across ranks (prompt ids: "
                                     "rank(s) [0] ")
    assert "rank(s) [1]" in said["prompt"] and "prompts:" not in said["prompt"]
    assert "prompts: rank(s) [0] 1, rank(s) [1] 2" in said["count"]
    assert said["params"].startswith("generate() call 4 differs across ranks "
                                     "(sampling_params.max_tokens: rank(s) [0] 8, rank(s) [1] 4)")
    assert "sampling_params" not in said["count"]  # the same SamplingParams for every prompt
    assert said["bad on one"].startswith(
        'generate() call 5 differs across ranks (error: rank(s) [0] "ValueError: prompt 0: '
        'prompt token ids [1000000000] outside the vocabulary [0, 2048)", rank(s) [1] none)')
    assert said["LLM()"].startswith("LLM() differs across ranks (block_size: rank(s) [0] "
                                    "\"4\", rank(s) [1] \"5\")")
    assert said["only rank 0"].startswith("rank(s) [1] of 2 did not reach generate() call 1 "
                                          "within dist_timeout=3 s")
    assert 3 <= r0["waited"] < 8
    # Rank 1 comes late: rank 0 stopped waiting, so rank 1 must not step alone.
    assert r1["said"]["late"].startswith("rank(s) [0] stopped waiting for this rank at "
                                         "generate() call 1 (dist_timeout=3 s)")
    for r in results:  # both out of step now: each refuses the next call
        assert r["after late"].startswith("this rank's engine may be out of step with the "
                                          "others (")
    assert "(it stopped waiting for rank(s) at generate() call 1)" in r0["after late"]
    assert "(rank(s) [0] stopped waiting for it at generate() call 1)" in r1["after late"]
    # A refusal on one rank only, before and after the world is joined: every later LLM()
    # still meets its peers (each LLM() a runtime of its own on every rank).
    assert r0["said"]["one rank refused"].startswith("LLM() differs across ranks (error: "
                                                     "rank(s) [0] none, rank(s) [1] \"Config")
    assert r0["said"]["refused before joining"] == r1["said"]["refused before joining"]
    assert r0["said"]["refused before joining"].startswith(
        "LLM() differs across ranks (error: rank(s) [0] none, rank(s) [1] \"ValueError: "
        "tp_size=0: expected a whole number >= 1")
    assert r0["said"]["memory refused before joining"].startswith(
        "LLM() differs across ranks (error: rank(s) [0] none, rank(s) [1] \"ConfigError: "
        "kv_cache_memory='lots'")
    assert r0["refused in"] < 30  # not dist_timeout=60 twice
    assert r1["said"]["alone"].startswith("rank(s) [0] of 2 did not join within "
                                          "dist_timeout=2 s")
    assert r1["alone in"] < 30
    assert r0["retried"] == r1["retried"] == r0["right"]
    assert r0["said"]["other weights"] == r1["said"]["other weights"]
    assert re.match(r'LLM\(\) differs across ranks \(model: rank\(s\) \[0\] "checkpoint '
                    r'[0-9a-f]{16} \(files the engine reads, weights sampled\)", rank\(s\) \[1\] '
                    r'"checkpoint [0-9a-f]{16} ', r0["said"]["other weights"])


@pytest.mark.parametrize("kw, named", [
    ({"tp_size": 0}, "tp_size=0"), ({"attn_dp_size": 0}, "attn_dp_size=0"),
    ({"dist_timeout": -5}, "dist_timeout=-5"), ({"dist_timeout": "300"}, "dist_timeout='300'"),
    ({"dist_timeout": math.nan}, "dist_timeout=nan"), ({"dist_timeout": 1e14}, "dist_timeout=1"),
    ({"dist_timeout": 10**400}, "dist_timeout=1000"), ({"dist_timeout": 1e13}, "dist_timeout=1"),
    ({"device": "gpu"}, "device='gpu': expected one of 'auto', 'cpu', 'cuda'"),
    ({"device": "cuda:1"}, "device='cuda:1': expected .* without an index: each rank takes "
                           "cuda:LOCAL_RANK"),
    ({"kv_cache_memory": "1" + "0" * 400 + "GiB"}, "kv_cache_memory='1000"),  # OverflowError
])
def test_bad_topology_arguments_are_named(kw, named):
    from dspark_launch import LLM
    from dspark_launch.errors import ConfigError

    with pytest.raises((ValueError, ConfigError), match=named.replace("(", r"\(")):
        LLM(**{**ARGS, **kw})


def test_a_torch_device_with_an_index_is_named():
    import torch

    from dspark_launch import LLM

    with pytest.raises(ValueError, match=r"device=device\(type='cuda', index=1\): expected "
                                         r"one of .* without an index"):
        LLM(**{**ARGS, "device": torch.device("cuda", 1)})


def test_cuda_asked_where_torch_sees_none_is_named():
    import torch

    from dspark_launch import LLM

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    for device in ("cuda", torch.device("cuda")):  # the same name
        with pytest.raises(ValueError, match="device='cuda': this torch sees no CUDA device"):
            LLM(**{**ARGS, "device": device})


def _interrupted_on_one_rank(rank: int) -> dict:
    from dspark_launch import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0)
    out: dict = {}
    with LLM(dist_timeout=5, **ARGS) as llm:
        step, steps = llm.engine.step, [0]

        def interrupted_step():
            steps[0] += 1
            if rank == 0 and steps[0] == 3:
                raise KeyboardInterrupt  # caught by the program below, as Ctrl-C on one rank
            return step()

        llm.engine.step = interrupted_step
        try:
            llm.generate(heldout()[0], greedy)
        except BaseException as err:  # noqa: BLE001 - what each rank's program sees
            out["first"] = type(err).__name__
        llm.engine.step = step
        try:
            llm.generate(heldout()[0], greedy)
        except RuntimeError as err:
            out["next"] = str(err)
    return out


def test_a_generate_left_mid_batch_on_one_rank_is_not_carried_on():
    """Rank 0's program catches a Ctrl-C raised in its third step and calls generate() again,
    as a world of one may; rank 1 went on stepping. Before, the next call returned rank 0's
    engine's outputs on one rank and other tokens on the other (or waited in mismatched
    collectives); now every rank that left a batch refuses the next call, naming why."""
    r0, r1 = run_world(2, _interrupted_on_one_rank, timeout=120)
    assert r0["first"] == "KeyboardInterrupt" and "first" in r1
    assert r0["next"].startswith("this rank's engine may be out of step with the others (it "
                                 "left generate() call 1 mid-batch: KeyboardInterrupt)")
    assert r1["next"].startswith("this rank's engine may be out of step with the others (it "
                                 "left generate() call 1 mid-batch: ")


def _two_runtimes(rank: int) -> list[int]:
    """A runtime made without LLM() (as the CLI and scripts make theirs), destroyed, and made
    again with rank 1 two seconds late: each must meet its peers under its own store prefix."""
    import time

    import torch
    import torch.distributed as dist

    from dspark_launch.args import RunConfig
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    sums = []
    for again in (False, True):
        if again and rank == 1:
            time.sleep(2)
        init_parallel_runtime(RunConfig(tp_size=2, device="cpu", dist_timeout=15))
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        sums.append(int(total))
        destroy_parallel_runtime()
    return sums


def test_runtimes_made_one_after_another_each_meet_under_their_own_prefix():
    """Without a prefix of its own, the second runtime's rank 0 found rank 1's first arrival
    and gloo address in the store and connected to a closed listener."""
    assert run_world(2, _two_runtimes, timeout=120) == [[3, 3], [3, 3]]


def test_a_checkpoint_this_rank_cannot_read_is_named_not_raised(tmp_path):
    """_checkpoint raises no OSError (a rank raising before its check-in leaves its peers
    waiting dist_timeout): a path it cannot stat is compared as the path, with why; a missing
    path as the path, whether given as text or as a Path; a weights file the loader refuses
    (a FIFO: opened, it would block) is left to the loader to name."""
    from dspark_launch.api import _checkpoint

    assert _checkpoint(Path("/nonexistent/x")) == _checkpoint("/nonexistent/x") == \
        "/nonexistent/x"
    too_long = "/tmp/" + "a" * 300  # ENAMETOOLONG from stat
    assert _checkpoint(too_long).startswith(too_long + " (unreadable: [Errno 36]")
    assert _checkpoint(None) is None
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    (fifo / "config.json").write_text("{}")
    os.mkfifo(fifo / "model.safetensors")
    assert _checkpoint(fifo).startswith("checkpoint ")  # at once
