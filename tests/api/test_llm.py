"""`from dspark_launch import LLM, SamplingParams` on every rank of a user's program.

Oracles: the offline CLI job's outputs (same topology), and each request run alone for a
batch with mixed per-request SamplingParams.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multirank import run_world
from references import MAX_TOKENS, POOL, PROMPTS, heldout

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_torchrun_program_with_its_own_group_gets_the_cli_jobs_outputs(tmp_path):
    """examples/embed_llm.py (the README's Embed program) under real torchrun, 4 ranks,
    attn-dp 2, against the CLI job on the same topology."""
    from jobs import run_job

    out = tmp_path / "llm.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", str(ROOT / "examples/embed_llm.py"), "--attn-dp-size", "2", "--max-tokens",
           str(MAX_TOKENS), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    job = run_job(tmp_path, "cli", ["--prompts", str(PROMPTS), "--max-new-tokens",
                                    str(MAX_TOKENS), "--tp-size", "4", "--attn-dp-size", "2",
                                    *POOL], world=4, timeout=300)
    assert job.rcs == [0] * 4
    cli = sorted(job.records, key=lambda r: r["index"])
    assert [r["token_ids"] for r in rows[:32]] == [r["output_ids"] for r in cli]
    assert [r["text"] for r in rows[:32]] == [r["text"] for r in cli]
    assert all(r["accept_lens"] and min(r["accept_lens"]) >= 1 for r in rows[:32])


def _mixed_batch(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from dspark_launch import LLM, SamplingParams

    dist.init_process_group("gloo")  # the caller's own group, before LLM
    prompts = heldout()[:6]
    # Seeded draws are reproducible across batch compositions only at a fixed verify length:
    # the adaptive policy picks lengths from load, and a different length takes a different
    # (equally exact) path through rejection sampling.
    # A torch.device is taken by its name: the ranks agree though one wrote it as text.
    device = "cpu" if rank == 0 else torch.device("cpu")
    with LLM(kv_cache_memory="64MiB", device=device, speculative_policy="fixed") as llm:
        plain = llm.generate(prompts[5], SamplingParams(max_tokens=20, temperature=0))[0]
        stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 5]
        params = [
            SamplingParams(max_tokens=20, temperature=0),
            SamplingParams(max_tokens=20, temperature=0.9, seed=11),
            SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=-3),  # any int
            SamplingParams(max_tokens=20, temperature=1.0, top_p=0.8, seed=5),
            SamplingParams(max_tokens=20, temperature=0.9, seed=11, stop=["\n\n"]),
            SamplingParams(max_tokens=20, temperature=0, stop=[stop]),
        ]
        batch = llm.generate(prompts, params)
        alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        llm.engine.flush_prefix_cache()
        pages_free = llm.engine.space.is_full()
    # The caller's group survives shutdown().
    total = torch.tensor([1])
    dist.all_reduce(total)
    view = lambda o: (o.text, o.token_ids, o.finish_reason, o.stop_reason)  # noqa: E731
    return {"batch": [view(o) for o in batch], "alone": [view(o) for o in alone],
            "stop": stop, "plain": plain.text, "group_ok": int(total) == dist.get_world_size(),
            "pages_free": pages_free, "initialized": dist.is_initialized()}


def test_per_request_sampling_params_give_what_each_gets_alone():
    results = run_world(2, _mixed_batch, timeout=300)
    assert results[0] == results[1]  # every rank returns the same outputs
    r = results[0]
    assert r["batch"] == r["alone"]
    assert r["group_ok"] and r["initialized"] and r["pages_free"]
    # The stop string cut the greedy text exactly where it starts.
    text, _, reason, stop_reason = r["batch"][5]
    assert text == r["plain"][:r["plain"].find(r["stop"])] and reason == "stop"
    assert stop_reason == r["stop"]
    # Different seeds and temperatures did sample different continuations.
    assert len({t for t, *_ in r["batch"][1:4]}) == 3


def _stops_and_edges(rank: int) -> dict:
    from dspark_launch import LLM, SamplingParams
    from dspark_launch.errors import ConfigError

    prompt = heldout()[0]
    out: dict = {}
    with LLM(kv_cache_memory="64MiB", device="cpu", speculative_policy="fixed") as llm:
        greedy = SamplingParams(max_tokens=20, temperature=0)
        plain = llm.generate(prompt, greedy)[0]
        ids = plain.token_ids
        k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # first new token
        decode = llm.tokenizer.decode
        out["plain"], out["k"] = ids, k
        out["decode"] = [decode(ids[:k]), decode(ids[:k + 1])]
        stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 4]
        out["stop"], out["plain_text"] = stop, plain.text
        views = {}
        for name, sp in {
            "stop_token": SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[k]]),
            "stop_token_kept": SamplingParams(max_tokens=20, temperature=0,
                                              stop_token_ids=[ids[k]],
                                              include_stop_str_in_output=True),
            "stop_string_kept": SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                               include_stop_str_in_output=True),
            "top_k_off": SamplingParams(max_tokens=12, temperature=1.0, seed=7),
            "top_k_huge": SamplingParams(max_tokens=12, temperature=1.0, seed=7, top_k=2**63),
            "top_p_tiny": SamplingParams(max_tokens=20, temperature=1.0, seed=7, top_p=1e-50),
        }.items():
            o = llm.generate(prompt, sp)[0]
            views[name] = (o.text, o.token_ids, o.finish_reason, o.stop_reason)
            out.setdefault("tpot", {})[name] = (o.tpot_s, len(o.token_ids))
        out["views"] = views
        vocab = llm.engine.target.config.vocab_size
        out["refused"] = []
        for bad in ([prompt], [[vocab + 1, 5]], ["a\ud800"]):
            sp = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab + 5]) \
                if bad == [prompt] else greedy
            try:
                llm.generate(bad[0], sp)
                out["refused"].append(None)
            except ValueError as err:
                out["refused"].append(str(err))
        out["after"] = llm.generate(prompt, greedy)[0].token_ids  # nothing lost
        out["vocab"] = vocab
        try:  # it joined the first one's parallel state, and broke when that one shut down
            LLM(kv_cache_memory="64MiB", device="cpu")
        except RuntimeError as err:
            out["second"] = str(err)
    try:
        llm.generate(prompt, greedy)
    except RuntimeError as err:
        out["after_shutdown"] = str(err)
    try:  # scheduled nothing: every request ended at once
        LLM(kv_cache_memory="64MiB", device="cpu", chunked_prefill_size=0)
    except ConfigError as err:
        out["counts"] = str(err)
    # Pages of 16 and a small pool: the start-up profile priced its blocks in tokens, not in
    # the pages each one takes, and the engine failed to start
    with LLM(kv_cache_memory="64MiB", device="cpu", max_total_tokens=512, page_size=16) as lm:
        out["paged"] = lm.generate(prompt, greedy)[0].token_ids
    return out


def test_stop_tokens_extreme_sampling_values_bad_ids_and_bad_engines():
    """The token that stopped a request is in its token ids, not in its text (vLLM's rule),
    unless include_stop_str_in_output, which keeps a stop string too; a top_k past the
    vocabulary is no top_k (it overflowed the step's int64 upload before), a top_p float32
    reads as 0 keeps the top token (greedy's); token ids outside the vocabulary in a prompt
    or in stop_token_ids (indexed by min_tokens' ban: an IndexError in the step) are refused
    before anything runs, and the engine goes on. One LLM at a time, none used after its
    shutdown, counts checked as the CLI checks them, and pages of 16 in a small pool; a TPOT
    for a request a stop string ended."""
    r = run_world(1, _stops_and_edges, timeout=300)[0]
    ids, k, v = r["plain"], r["k"], r["views"]
    assert v["stop_token"] == (r["decode"][0], ids[:k + 1], "stop", ids[k])
    assert v["stop_token_kept"] == (r["decode"][1], ids[:k + 1], "stop", ids[k])
    text, _, reason, stop_reason = v["stop_string_kept"]
    cut = r["plain_text"].find(r["stop"]) + len(r["stop"])
    assert (text, reason, stop_reason) == (r["plain_text"][:cut], "stop", r["stop"])
    # Every request of more than one token has a TPOT; one a stop string ended had none
    # (it ends before the engine's finish time exists), and left the TPOT histogram.
    assert all(t is not None and t > 0 for t, n in r["tpot"].values() if n > 1), r["tpot"]
    assert r["tpot"]["stop_string_kept"][1] > 1
    assert v["top_k_huge"] == v["top_k_off"]
    assert v["top_p_tiny"][1] == ids
    vocab = r["vocab"]
    assert r["refused"] == [
        f"prompt 0: stop_token_ids [{vocab + 5}] outside the vocabulary [0, {vocab})",
        f"prompt 0: prompt token ids [{vocab + 1}] outside the vocabulary [0, {vocab})",
        "prompt 0 holds '\\ud800' at character 1, a lone surrogate (not Unicode text): send "
        "valid UTF-16 pairs or the character itself"]  # was the tokenizer's TypeError
    assert r["after"] == ids
    assert r["second"] == ("an LLM is already running in this process; shutdown() it first "
                           "(one engine per process)")
    assert r["after_shutdown"] == "generate() after shutdown(): build a new LLM"
    assert r["counts"] == "chunked_prefill_size=0 must be >= 1"
    assert r["paged"] == ids


def test_world_of_one_without_torchrun_uses_the_embedded_model_and_its_defaults(offline):
    """LLM() with no model and no sampling params: the embedded family and
    generation_config.json (greedy, max_new_tokens 128)."""
    code = ("import json; from dspark_launch import LLM\n"
            "with LLM(kv_cache_memory='64MiB') as llm:\n"
            "    outs = llm.generate(PROMPTS)\n"
            "print(json.dumps([o.token_ids for o in outs]))\n")
    prompts = heldout()[:2]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-c", code.replace("PROMPTS", repr(prompts))],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    for prompt, ids in zip(prompts, outs):
        ref = offline[prompt]["output_ids"]
        assert ids[:len(ref)] == ref
        assert len(ids) == 128 or ids[-1] == 2046  # max_new_tokens or EOS


def _prompt_shapes_and_interrupts(rank: int, bare_model: str) -> dict:
    import numpy as np

    from dspark_launch import LLM, SamplingParams

    prompt = heldout()[1]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    out: dict = {"errors": []}
    with LLM(kv_cache_memory="64MiB", device="cpu", speculative_policy="fixed") as llm:
        ids = llm.tokenizer.encode(prompt).ids
        out["text"] = llm.generate(prompt, greedy)[0].token_ids
        # vLLM's dict prompts (they ran as the text "prompt" / "prompt_token_ids")
        out["dicts"] = [o.token_ids for o in llm.generate(
            [{"prompt": prompt}, {"prompt_token_ids": ids}], greedy)]
        out["one_dict"] = llm.generate({"prompt": prompt}, greedy)[0].token_ids
        out["numpy_ids"] = [o.token_ids for o in (
            llm.generate([np.array(ids).tolist()[:3] + [np.int64(ids[3])]], greedy)
            + llm.generate(np.array(ids[:4]), greedy)
            + llm.generate([np.array(ids[:4])], greedy)
            + llm.generate({"prompt_token_ids": np.array(ids[:4])}, greedy))]
        out["ids4"] = llm.generate([ids[:4]], greedy)[0].token_ids
        for bad, sp in (([None], greedy), ([ids, [3, None]], greedy),
                        ({"text": prompt}, greedy), ([prompt, prompt], [greedy, {"n": 1}])):
            try:
                llm.generate(bad, sp)
                out["errors"].append(None)
            except TypeError as err:
                out["errors"].append(str(err))
        # Ctrl-C in the middle of a batch: its requests ran on to max_tokens inside the next
        # generate() (13.6 s for 8 tokens), holding their pages.
        engine, real_step, calls = llm.engine, llm.engine.step, [0]

        def interrupted_step():
            calls[0] += 1
            if calls[0] == 4:
                raise KeyboardInterrupt
            return real_step()

        engine.step = interrupted_step
        try:
            llm.generate([prompt, prompt[::-1]],
                         SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
        except KeyboardInterrupt:
            out["interrupted"] = True
        engine.step = real_step
        before = engine.steps
        out["after"] = llm.generate(prompt, greedy)[0].token_ids
        out["steps_after"] = engine.steps - before
        engine.flush_prefix_cache()
        out["pages_free"] = engine.space.is_full()
    # A checkpoint without tokenizer.json: token ids in and out (its detokenizer crashed)
    with LLM(bare_model, kv_cache_memory="64MiB", device="cpu",
             speculative_algorithm="NONE") as bare:
        o = bare.generate([[3, 4, 5]], greedy)[0]
        out["bare"] = (o.token_ids, o.text)
        try:
            bare.generate([[3, 4, 5]], SamplingParams(max_tokens=4, stop=["x"]))
        except ValueError as err:
            out["bare_stop"] = str(err)
    return out


def test_prompt_shapes_bad_prompts_interrupts_and_no_tokenizer(tiny):
    """vLLM's {"prompt": ...} / {"prompt_token_ids": ...} prompts run as their text / ids (a
    dict ran its key as the prompt); numpy ids are ids; a bad prompt or sampling_params is a
    TypeError naming it; a generate() interrupted mid-batch leaves nothing running into the
    next one; a checkpoint without a tokenizer answers token ids with empty text."""
    from jobs import reference, write_prompts

    r = run_world(1, _prompt_shapes_and_interrupts, str(tiny.target), timeout=300)[0]
    assert r["dicts"] == [r["text"], r["text"]] and r["one_dict"] == r["text"]
    assert r["numpy_ids"] == [r["ids4"]] * 4
    assert r["errors"] == [
        "prompt 0 must be a string or a list of token ids, got NoneType",
        "prompt 1 must be a string or a list of token ids, got a list holding NoneType None",
        "prompt 0: a dict prompt has one key, 'prompt' (text) or 'prompt_token_ids' (token "
        "ids), got ['text']",
        "sampling_params[1] must be a SamplingParams, got dict"]
    assert r["interrupted"] and r["after"] == r["text"]
    assert r["steps_after"] < 20, r["steps_after"]  # 6 tokens, not 1500 of two others
    assert r["pages_free"]
    ref = reference(tiny, write_prompts(tiny.root / "bare.jsonl", [{"input_ids": [3, 4, 5]}]),
                    6)
    assert r["bare"] == (ref[0], "")
    assert r["bare_stop"] == ("prompt 0: stop=['x'] needs the checkpoint's tokenizer.json "
                              "(give stop_token_ids)")
