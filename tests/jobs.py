"""Shared helpers for the engine and spec tests: tiny checkpoints, prompt files, whole jobs.

A job is the real entry, `dspark_launch.__main__.main(argv)`, called in-process (a world of
one) or on every rank of a forked gloo world (`tests/multirank.run_world`), exactly as torchrun
would start it. The oracle for every output is plain greedy decoding through the NONE path at
tp1 with each prompt running alone (`--max-running-requests 1`, ample KV), which the model
team checks against HF transformers (and `test_reference_matches_hf` re-checks here).

Probes (installed inside the ranks, after the fork) record what the job's output cannot show:
the allocator and request->token table after the run, and per-round proposals/verifies.
"""

from __future__ import annotations

import gc
import json
import random
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from checkpoints import write_checkpoint
from draft_checkpoints import write_draft
from multirank import run_world

# Tiny target (3 layers: features [0, 1] for the drafts): 4 query heads / 2 KV heads shard
# over attn_tp 1 or 2; MLP (64) and vocab (128) shard over tp up to 8.
TARGET = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8)
VOCAB = TARGET["vocab_size"]
EOS = 1  # write_checkpoint's eos_token_id
# A big enough pool that nothing waits: the reference and the spec tests.
AMPLE = ["--kv-cache-memory", "64MiB", "--max-total-tokens", "4096"]
# torch's GEMM: outputs compared across topologies and against references then round alike
# whatever each run's start-up timing chose (tests/engine/test_gemm_choice.py and
# tests/models/test_gemm.py run the packed kernel)
QUIET = ["--log-level", "WARNING", "--device", "cpu", "--cpu-gemm", "torch"]


@dataclass(frozen=True)
class Assets:
    root: Path
    target: Path
    small_vocab: Path  # vocab 16, no EOS: distribution tests
    loopy: Path  # tied embeddings, small weights: greedy output falls into loops (NGRAM)
    prompts64: Path  # 64 mixed-length token-id prompts, mixed per-line max_new_tokens
    prompts12: Path  # 12 prompts of lengths 1..34 for the spec matrix

    def dflash(self, block: int) -> Path:
        return _draft(self.root, self.target, "DFLASH", block)

    def dspark(self, block: int, **options) -> Path:
        return _draft(self.root, self.target, "DSPARK", block, **options)

    def small_draft(self, kind: str, block: int) -> Path:
        return _draft(self.root, self.small_vocab, kind, block)


def _model_config(path: Path):
    from dspark_launch.models.config import ModelConfig

    return ModelConfig.from_dict(json.loads((path / "config.json").read_text()))


def _draft(root: Path, target: Path, kind: str, block: int, **options) -> Path:
    tag = "_".join(f"{k}{v}" for k, v in sorted(options.items()))
    path = root / f"{target.name}_{kind.lower()}_b{block}{'_' + tag if tag else ''}"
    if not (path / "config.json").is_file():
        write_draft(path, _model_config(target), kind, block_size=block, num_layers=1,
                    target_layer_ids=[0, 1], seed=block, target_weights=target, **options)
    return path


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def random_prompts(n: int, lengths: list[int], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    # Avoid EOS and the mask id inside prompts (they are legal, but keep prompts plain).
    return [[rng.randrange(2, vocab - 1) for _ in range(lengths[i % len(lengths)])]
            for i in range(n)]


@cache
def assets(root: str) -> Assets:
    # transformers' save_pretrained shows a tqdm bar whose monitor thread would outlive it;
    # these processes fork rank worlds later, and forking with live threads invites deadlocks.
    import tqdm

    tqdm.tqdm.monitor_interval = 0
    root_p = Path(root)
    root_p.mkdir(parents=True, exist_ok=True)
    target = root_p / "target"
    if not (target / "config.json").is_file():
        write_checkpoint(target, "qwen3", **TARGET)
    small = root_p / "small_vocab"
    if not (small / "config.json").is_file():
        write_checkpoint(small, "qwen3", vocab_size=16, hidden_size=32, intermediate_size=64,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, init_std=0.1,
                         generation_eos=[], seed=3)
    loopy = root_p / "loopy"
    if not (loopy / "config.json").is_file():
        write_checkpoint(loopy, "qwen3", **TARGET, tied=True, init_std=0.05)
    lengths = [1, 3, 24, 7, 16, 2, 11, 20, 5, 9, 13, 4, 18, 6, 22, 8]
    rows = []
    for i, ids in enumerate(random_prompts(64, lengths, seed=1)):
        row = {"input_ids": ids, "id": f"req-{i}"}
        if i % 5 == 0:
            row["max_new_tokens"] = 4 + i % 7  # per-line override of --max-new-tokens
        rows.append(row)
    p64 = write_prompts(root_p / "prompts64.jsonl", rows)
    p12 = write_prompts(root_p / "prompts12.jsonl", [
        {"input_ids": ids} for ids in random_prompts(12, [1, 34, 5, 17, 2, 9, 28, 3, 12, 6,
                                                           21, 14], seed=2)])
    return Assets(root_p, target, small, loopy, p64, p12)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ----------------------------------------------------------------------------- running jobs


@dataclass
class Job:
    rcs: list[int]
    records: list[dict]
    metrics: dict | None
    probes: list[dict]  # one per rank (empty dicts without probes)

    @property
    def outputs(self) -> list[list[int]]:
        return [r["output_ids"] for r in self.records]


def _rank_main(rank: int, argv: list[str], probe) -> dict:
    from dspark_launch.__main__ import main

    if probe is not None:
        probe.install()
    rc = main(argv)
    return {"rc": rc, "probe": probe.result() if probe is not None else {}}


def run_job(out_dir: Path, name: str, argv: list[str], world: int = 1, probe=None,
            timeout: float = 120.0) -> Job:
    """Run the whole job on `world` ranks; read back its JSONL output and metrics JSON."""
    out = out_dir / f"{name}.jsonl"
    metrics = out_dir / f"{name}.metrics.json"
    full = [*argv, "--output", str(out), "--overwrite", "--metrics-json", str(metrics), *QUIET]
    if world == 1:
        try:
            results = [_rank_main(0, full, probe)]
        finally:
            if probe is not None:
                probe.uninstall()
    else:
        # A world of one run in this process leaves its destroyed gloo group in a reference
        # cycle; if the garbage collector first meets it in a forked rank, its destructor
        # joins threads that did not survive the fork and the rank hangs. Free it here.
        gc.collect()
        results = run_world(world, _rank_main, full, probe, timeout=timeout)
    rcs = [r["rc"] for r in results]
    records = read_jsonl(out) if out.exists() else []
    m = json.loads(metrics.read_text()) if metrics.exists() else None
    return Job(rcs, records, m, [r["probe"] for r in results])


def model_args(a: Assets, algorithm: str, block: int | None = None, draft: Path | None = None
               ) -> list[str]:
    # Fixed verify lengths (every draft verified): engine tests assert on what full blocks do;
    # tests/policy passes --speculative-policy adaptive after these (the last flag wins).
    argv = ["--model", str(a.target), "--speculative-algorithm", algorithm,
            "--speculative-policy", "fixed"]
    if draft is not None:
        argv += ["--draft", str(draft)]
    if block is not None:
        argv += ["--block-size", str(block)]
    return argv


def topology(tp: int, dp: int) -> list[str]:
    return ["--tp-size", str(tp), "--attn-dp-size", str(dp)]


@cache
def _reference(root: str, prompts: str, max_new: int, out_dir: str, model: str
               ) -> tuple[tuple[int, ...], ...]:
    job = run_job(Path(out_dir), f"ref_{Path(model).name}_{Path(prompts).stem}_{max_new}",
                  ["--model", model, "--speculative-algorithm", "NONE", "--prompts", prompts,
                   "--max-new-tokens", str(max_new), "--max-running-requests", "1", *AMPLE])
    assert job.rcs == [0]
    assert all(r["preemptions"] == 0 for r in job.records)
    return tuple(tuple(o) for o in job.outputs)


def reference(a: Assets, prompts: Path, max_new: int, model: Path | None = None
              ) -> list[list[int]]:
    """Plain greedy outputs (NONE, tp1, one request at a time) for every prompt line."""
    out = a.root / "ref"
    out.mkdir(exist_ok=True)
    model = a.target if model is None else model
    return [list(o) for o in _reference(str(a.root), str(prompts), max_new, str(out),
                                        str(model))]


def prompt_ids(prompts: Path) -> list[list[int]]:
    return [r["input_ids"] for r in read_jsonl(prompts)]


# ----------------------------------------------------------------------------- probes


class Probe:
    """Installed on each rank before main(): a subclass of the engine that records its state
    when the job shuts it down, and what each step verified: per decode request its drafts
    and how many were accepted (plain steps too: 0 drafts)."""

    def install(self) -> None:
        import dspark_launch.engine.build as build_mod
        import dspark_launch.engine.engine as engine_mod

        self._saved = [(build_mod, "Engine", build_mod.Engine),
                       (engine_mod, "accept", engine_mod.accept)]
        self.after: dict = {}
        self.verifies: list[tuple[int, int, int]] = []  # (step, draft_len, accept_len)
        probe = self
        base = build_mod.Engine
        real_accept = engine_mod.accept

        class ProbeEngine(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.here: list = []

            def _admit(self, req):
                self.here.append(req)
                super()._admit(req)

            def step(self):
                probe.step = self.steps
                return super().step()

            def shutdown(self):
                space = self.space
                probe.after = {
                    "is_full": space.is_full(),
                    "free_pages": space.allocator.num_free_pages,
                    "num_pages": space.allocator.num_pages,
                    "table_rows_held": int((space.req_to_token != 0).sum()),
                    "slots_held": sum(p is not None for p in space._pages),
                    "has_draft_pool": self.memory.draft is not None,
                    "requests_here": sorted(r.index for r in self.here),
                    "unfinished": [r.index for r in self.here if r.finish_reason is None],
                    "steps": self.steps,
                }
                super().shutdown()

        def recording_accept(target, layout, *args):
            done = real_accept(target, layout, *args)
            for n, a_len in zip(layout.widths, done.accept_len.tolist()):
                probe.verifies.append((probe.step, n, a_len))
            return done

        build_mod.Engine = ProbeEngine
        engine_mod.accept = recording_accept
        self.step = -1

    def uninstall(self) -> None:
        for mod, name, value in self._saved:
            setattr(mod, name, value)

    def result(self) -> dict:
        return {"after": self.after, "verifies": self.verifies}


class ProposerProbe(Probe):
    """Also swaps the proposer class the factory builds (a test drafter)."""

    def __init__(self, module: str, name: str, make_cls, *cls_args) -> None:
        self.module, self.name, self.make_cls, self.cls_args = module, name, make_cls, cls_args

    def install(self) -> None:
        import importlib

        super().install()
        mod = importlib.import_module(self.module)
        original = getattr(mod, self.name)
        self._saved.append((mod, self.name, original))
        self.cls = self.make_cls(original, *self.cls_args)
        self.cls.log = defaultdict(list)
        setattr(mod, self.name, self.cls)

    def result(self) -> dict:
        out = super().result()
        out["log"] = dict(self.cls.log)
        return out


# ----------------------------------------------------------------------------- test drafters


def corrupt(index: int, pos: int, j: int) -> bool:
    """Which oracle drafts are spoiled: a deterministic ~1-in-7 pattern over (request, pos)."""
    return (index * 131 + pos * 31 + j * 17) % 7 == 0


def make_drafter(base, full: dict[int, list[int]], mode: str, k: int = 5, vocab: int = VOCAB):
    """A proposer class derived from `base` (the factory's Proposer or DFlashProposer).

    `full[index]` is the reference prompt + greedy output. mode "oracle": propose the true
    continuation with the `corrupt` positions changed, so the same step sees full blocks
    accepted and blocks cut short; "garbage": a first draft that is always wrong; "record":
    leave the drafts alone. Model drafters also log their raw drafts by (index, kv_len).
    """

    class TestDrafter(base):
        name = f"TEST-{mode}"

        @property
        def max_drafts(self) -> int:
            return base.max_drafts.fget(self) if hasattr(self, "block_size") else k

        def propose(self, reqs, limits, rows):
            from dspark_launch.spec.proposer import Proposal

            proposal = base.propose(self, reqs, limits, rows)
            raw = proposal.tokens.tolist()  # test-only host reads
            tokens = []
            for i, (req, lim) in enumerate(zip(reqs, limits)):
                mine = raw[i][:proposal.widths[i]]
                if hasattr(self, "block_size"):
                    TestDrafter.log["raw"].append((req.index, req.kv_len, list(raw[i])))
                    TestDrafter.log["kept"].append((req.index, proposal.widths[i]))
                seq, pos = full.get(req.index), len(req.all_ids)
                if seq is not None:
                    assert seq[:pos] == req.all_ids, "the engine committed a non-greedy token"
                if mode == "oracle":
                    cont = seq[pos:pos + lim]
                    toks = [(t + 1) % vocab if corrupt(req.index, pos, j) else t
                            for j, t in enumerate(cont)]
                elif mode == "garbage":
                    toks = [(seq[pos] + 1 + j) % vocab for j in range(lim)] if pos < len(seq) \
                        else []
                else:
                    toks = mine
                TestDrafter.log["drafts"].append((req.index, pos, toks[:lim]))
                tokens.append(toks[:lim])
            if mode == "record":
                return proposal  # the drafter's own drafts, distributions and cut
            return Proposal.from_lists(tokens, proposal.tokens.device)  # point masses

    return TestDrafter


def with_tokenizer(a: Assets) -> Path:
    """The target plus a word-level tokenizer.json ("w0" .. "w127", split on spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = a.root / "target_tok"
    if not (path / "tokenizer.json").is_file():
        path.mkdir(exist_ok=True)
        for f in a.target.iterdir():
            dst = path / f.name
            if not dst.exists():
                dst.symlink_to(f)
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
        tok.save(str(path / "tokenizer.json"))
    return path


# ----------------------------------------------------------------------------- the engine API


@dataclass(frozen=True)
class Arrival:
    """A client event at a given step of an engine drive: add a spec or abort a rid."""

    step: int
    spec: object = None  # RequestSpec
    abort: str | None = None


def _drive_rank(rank: int, tp: int, dp: int, engine_args, arrivals: list[Arrival],
                alone: bool) -> dict:
    """On one rank: init the parallel state, build the engine, feed it `arrivals` by step
    (or, with `alone`, each add on its own, run to completion before the next), step until
    idle. Returns every step's outputs, the device->host copies per step, the pool state."""
    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime
    from dspark_launch.spec import transfer

    init_parallel_runtime(RunConfig(tp_size=tp, attn_dp_size=dp, device="cpu"))
    engine = build_engine(engine_args)
    steps: list[list] = []
    copies: list[int] = []
    drafted: list[int] = []

    def one_step() -> None:
        before = transfer.copies
        steps.append(engine.step())
        copies.append(transfer.copies - before)
        drafted.append(engine.last_step.drafted)

    if alone:
        for a in arrivals:
            engine.add_request(a.spec)
            one_step()
            while engine.has_work:
                one_step()
    else:
        last = max((a.step for a in arrivals), default=0)
        step = 0
        while step <= last or engine.has_work:
            for a in arrivals:
                if a.step == step:
                    if a.spec is not None:
                        engine.add_request(a.spec)
                    else:
                        engine.abort(a.abort)
            one_step()
            step += 1
    engine.flush_prefix_cache()  # cached pages go back: the allocator must be full again
    result = {"steps": steps, "copies": copies, "drafted": drafted,
              "pool_full": engine.space.is_full(),
              "table_clear": int((engine.space.req_to_token != 0).sum()) == 0}
    engine.shutdown()
    return result


def drive(engine_args, arrivals: list[Arrival], world: int = 1, dp: int = 1,
          alone: bool = False, timeout: float = 180.0) -> list[dict]:
    """Run the engine API on a forked gloo world; one result per rank (see _drive_rank)."""
    gc.collect()
    return run_world(world, _drive_rank, world, dp, engine_args, arrivals, alone,
                     timeout=timeout)


def final_outputs(result: dict) -> dict:
    """rid -> the last RequestOutput reported for it."""
    out = {}
    for outs in result["steps"]:
        for o in outs:
            out[o.rid] = o
    return out


def spec(index: int, prompt: list[int], rid: str | None = None, **params):
    from dspark_launch.engine.params import SamplingParams
    from dspark_launch.engine.request import RequestSpec

    return RequestSpec(index=index, rid=rid or f"r{index}", prompt_ids=tuple(prompt),
                       params=SamplingParams(**params))


def engine_args(a: Assets, algorithm: str, draft: Path | None = None, model: Path | None = None,
                **kw):
    from dspark_launch.engine.build import EngineArgs

    kw.setdefault("speculative_policy", "fixed")  # as model_args
    kw.setdefault("cpu_gemm", "torch")  # as QUIET
    return EngineArgs(model=str(model or a.target), speculative_algorithm=algorithm,
                      draft=None if draft is None else str(draft),
                      kv_cache_memory=64 * 2**20, max_total_tokens=4096, **kw)


def _idle_signal_rank(rank: int, engine_args) -> dict:
    """Idle engine on every rank; rank 1 (or 0 alone) gets SIGTERM while rank 0 is parked on
    its inbox. Every rank must leave step() with Interrupted(SIGTERM)."""
    import os
    import signal
    import threading

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.failure import Interrupted, install_signal_handlers
    from dspark_launch.parallel import get_parallel, init_parallel_runtime

    install_signal_handlers()
    init_parallel_runtime(RunConfig(tp_size=get_world(), attn_dp_size=1, device="cpu"))
    engine = build_engine(engine_args)
    if rank == get_parallel().world_size - 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    idle_steps = 0
    try:
        while idle_steps < 100:
            assert engine.step() == []
            idle_steps += 1
    except Interrupted as err:
        return {"exit_code": err.exit_code, "idle_steps": idle_steps}
    finally:
        engine.shutdown()
    return {"exit_code": None, "idle_steps": idle_steps}


def get_world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))
