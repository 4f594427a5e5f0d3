"""Pool configurator: the per-rank KV budget, the token count it buys, and the self-check.

Every KV-head count here reads the LIVE get_parallel().attn_tp_size (through
KVGeometry.cell_bytes), never cfg.tp_size: pricing the draft at the raw tp width under-counts
it by up to attn_dp_size and the draft pool OOMs (DESIGN.md, "The bug this project must
never have"). self_check() proves, from the real buffers, that priced == allocated.

Accounting: the budget covers the step's transients (memory/transients.py) and every row
the pools allocate, INCLUDING the dummy page 0, so
    pages  = floor((budget - transients) / (target_cell + draft_cell)) // page_size - 1
    max_total_tokens = pages * page_size     (then MIN across ranks, then the cap)
and (max_total_tokens + page_size) * (target_cell + draft_cell) + transients <= budget.

Which rule set the budget travels with it (`budget_rule`): --kv-cache-memory; on CUDA the
static fraction of free memory; on CPU without a flag, what the run can use (max running
requests x their context, both pools, plus transients) capped by a share of the RAM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from dspark_launch.errors import ConfigError, LaunchError
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.transients import StepShape, price_step
from dspark_launch.parallel import get_parallel

GIB = 1024**3
# CPU default: ranks of a node share this fraction of MemAvailable. 30% leaves room for
# both models' weights (and the projections' packed copies, engine/gemm_choice.py: at most
# 20% of MemAvailable), activations and the OS; pass --kv-cache-memory to choose exactly.
CPU_RAM_SHARE = 0.30


class PoolPricingError(LaunchError):
    """A pool holds a different number of bytes per token than the budget priced."""


# ---------------------------------------------------------------- budget per rank


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise LaunchError("/proc/meminfo has no MemAvailable line; pass --kv-cache-memory")


def measure_free_bytes(device) -> int:
    """Free memory where the pools will live: CUDA free bytes, else MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return mem_available_bytes()


def cuda_budget(free_before_load: int, free_after_load: int, mem_fraction_static: float) -> int:
    """SGLang's rule: weights + KV share the static fraction of what was free before loading.

    budget = free_after - free_before * (1 - fraction); the weights already loaded are the
    difference free_before - free_after, so they are charged against the fraction.
    """
    return int(free_after_load - free_before_load * (1.0 - mem_fraction_static))


def ram_share_bytes() -> int:
    """CPU_RAM_SHARE of MemAvailable split across the ranks of this node (one RAM)."""
    return int(mem_available_bytes() * CPU_RAM_SHARE) // max(1, get_parallel().local_world_size)


def fit_budget(need_bytes: int | None) -> tuple[int, str]:
    """CPU without --kv-cache-memory: what the run can use, capped by the RAM share."""
    share = ram_share_bytes()
    rule = (f"RAM share: {CPU_RAM_SHARE:.0%} of MemAvailable / "
            f"{get_parallel().local_world_size} local rank(s)")
    if need_bytes is None or need_bytes > share:
        return share, rule + ("" if need_bytes is None else f" (the run could use {need_bytes})")
    return int(need_bytes), (f"fit: max running requests x context, both pools + transients "
                             f"(under the RAM share {share})")


def run_need_bytes(cell: int, page_size: int, max_running: int, request_rows: int,
                   transients: int) -> int:
    """Bytes the pools can ever use: every running request at its row limit (whole pages),
    plus the dummy page, plus the step's transients. plan_memory() turns exactly this
    budget back into max_running * ceil(request_rows / page_size) pages."""
    pages = max_running * -(-request_rows // page_size) + 1
    return pages * page_size * cell + transients


def rank_budget(cfg, device, free_before_load: int | None = None,
                need_bytes: int | None = None) -> tuple[int, str]:
    """This rank's KV budget in bytes and the rule that set it. --kv-cache-memory wins on
    any device; need_bytes (run_need_bytes) is what a CPU default sizes to."""
    device = torch.device(device)
    if cfg.kv_cache_memory is not None:
        return int(cfg.kv_cache_memory), "--kv-cache-memory"
    if device.type != "cuda":
        return fit_budget(need_bytes)
    if free_before_load is None:
        raise LaunchError("CUDA budget needs free_before_load, measured before loading weights")
    budget = cuda_budget(free_before_load, measure_free_bytes(device), cfg.mem_fraction_static)
    if budget <= 0:
        raise ConfigError(
            f"no KV memory left on {device}: free after loading weights - free before "
            f"({free_before_load / GIB:.2f} GiB) * (1 - --mem-fraction-static="
            f"{cfg.mem_fraction_static}) = {budget / GIB:.2f} GiB; raise --mem-fraction-static"
        )
    return budget, f"free after weights - free before x (1 - {cfg.mem_fraction_static})"


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    target_cell: int  # bytes per token in the target pool on this rank
    draft_cell: int  # 0 when there is no draft
    page_size: int
    max_total_tokens: int  # rows handed out per pool (the dummy page is extra)
    tokens_before_cap: int  # after the MIN across ranks, before --max-total-tokens
    target_kv_heads_per_rank: int
    draft_kv_heads_per_rank: int  # 0 when there is no draft
    tp_size: int
    attn_tp_size: int
    attn_dp_size: int
    tp_rank: int = 0
    attn_tp_rank: int = 0
    attn_dp_rank: int = 0
    transient_bytes: int = 0  # the step's transients, reserved before the pools
    budget_rule: str = ""  # which rule set budget_bytes

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.max_total_tokens < self.page_size:
            raise ValueError(f"plan needs >= one page: {self}")
        if self.max_total_tokens % self.page_size:
            raise ValueError(f"max_total_tokens not a multiple of page_size: {self}")
        if self.pool_rows * self.cell + self.transient_bytes > self.budget_bytes:
            raise ValueError(f"plan exceeds its budget: {self}")

    @property
    def cell(self) -> int:
        return self.target_cell + self.draft_cell

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size

    @property
    def pool_rows(self) -> int:
        """Rows each pool allocates: the pages plus the dummy page 0."""
        return (self.num_pages + 1) * self.page_size

    @property
    def target_pool_gib(self) -> float:
        return self.pool_rows * self.target_cell / GIB

    @property
    def draft_pool_gib(self) -> float:
        return self.pool_rows * self.draft_cell / GIB

    @property
    def budget_gib(self) -> float:
        return self.budget_bytes / GIB

    @property
    def transient_gib(self) -> float:
        return self.transient_bytes / GIB

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            pool_rows=self.pool_rows,
            target_pool_gib=round(self.target_pool_gib, 4),
            draft_pool_gib=round(self.draft_pool_gib, 4),
            budget_gib=round(self.budget_gib, 4),
            transient_gib=round(self.transient_gib, 4),
        )
        return out


def context_of_pool(max_total_tokens: int, model_limit: int, round_rows: int) -> int:
    """The context a pool of `max_total_tokens` rows per rank serves: the model's, unless
    one request's prompt and its round's rows do not fit; refused below 2 (a prompt and one
    new token). The launch and --plan both ask here (the plan printed a pool the launch then
    refused)."""
    context = min(model_limit, max_total_tokens - round_rows + 1)
    if context < 2:
        raise ConfigError(
            f"the KV pool holds {max_total_tokens} tokens per rank, too few for one "
            f"round of {round_rows} rows; raise --kv-cache-memory or --max-total-tokens")
    return context


def smallest_budget(cell: int, page_size: int, transient_bytes: int = 0) -> int:
    """One usable page plus the dummy page, for both pools, plus the step's transients."""
    return 2 * page_size * cell + transient_bytes


def _budget_flag() -> str:
    on_cuda = get_parallel().device.type == "cuda"
    return "--mem-fraction-static" if on_cuda else "--kv-cache-memory"


def plan_memory(
    budget_bytes: int,
    target: KVGeometry,
    draft: KVGeometry | None,
    page_size: int,
    max_total_tokens_cap: int | None = None,
    transient_bytes: int = 0,
    budget_rule: str = "",
) -> MemoryPlan:
    """Price both pools at the live attn_tp width and size them to what the budget leaves
    after the step's transients. Pure."""
    state = get_parallel()
    target_cell = target.cell_bytes()
    draft_cell = draft.cell_bytes() if draft is not None else 0
    cell = target_cell + draft_cell
    need = smallest_budget(cell, page_size, transient_bytes)
    if budget_bytes < need:
        raise ConfigError(
            f"KV budget {budget_bytes} bytes ({budget_bytes / GIB:.3f} GiB) per rank is too "
            f"small: one page of each pool plus the dummy page plus the step's transients "
            f"needs {need} bytes ({need / GIB:.4f} GiB) = 2 * page_size={page_size} * "
            f"(target_cell={target_cell} + draft_cell={draft_cell}) at attn_tp_size="
            f"{state.attn_tp_size} + transients={transient_bytes}; raise {_budget_flag()}"
            f"{_transient_hint(transient_bytes)}"
        )
    pages = (budget_bytes - transient_bytes) // cell // page_size - 1  # minus the dummy page
    tokens = pages * page_size
    return MemoryPlan(
        budget_bytes=int(budget_bytes),
        target_cell=target_cell,
        draft_cell=draft_cell,
        page_size=page_size,
        max_total_tokens=_cap(tokens, max_total_tokens_cap, page_size),
        tokens_before_cap=tokens,
        target_kv_heads_per_rank=target.kv_heads_per_rank(),
        draft_kv_heads_per_rank=draft.kv_heads_per_rank() if draft is not None else 0,
        tp_size=state.tp_size,
        attn_tp_size=state.attn_tp_size,
        attn_dp_size=state.attn_dp_size,
        tp_rank=state.tp_rank,
        attn_tp_rank=state.attn_tp_rank,
        attn_dp_rank=state.attn_dp_rank,
        transient_bytes=int(transient_bytes),
        budget_rule=budget_rule,
    )


def _transient_hint(transient_bytes: int) -> str:
    if not transient_bytes:
        return ""
    return " or lower --max-running-requests / --chunked-prefill-size (they size the transients)"


def _cap(tokens: int, cap: int | None, page_size: int) -> int:
    if cap is None or cap >= tokens:
        return tokens
    capped = cap // page_size * page_size
    if capped < page_size:
        raise ConfigError(
            f"--max-total-tokens={cap} is less than one page (--page-size={page_size})"
        )
    return capped


def agree_across_ranks(plan: MemoryPlan) -> MemoryPlan:
    """MIN of the token counts over every rank, so all pools index the same rows.

    Capping is monotone, so the MIN of capped counts is the cap of the MIN count.
    """
    group = get_parallel().cpu_group
    if group is None or dist.get_world_size(group) == 1:
        return plan
    counts = torch.tensor([plan.tokens_before_cap, plan.max_total_tokens], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    before_cap, capped = (int(x) for x in counts.tolist())
    return replace(plan, tokens_before_cap=before_cap, max_total_tokens=capped)


def configure_memory(
    cfg,
    target: KVGeometry,
    draft: KVGeometry | None,
    device,
    free_before_load: int | None = None,
    step: StepShape | None = None,
    request_rows: int | None = None,
) -> MemoryPlan:
    """Budget -> plan -> agreement across ranks; what the engine calls after loading.

    step: the largest step (its transients are reserved); request_rows: the KV rows one
    request can ever hold (context limit + one round), which a CPU default sizes to.
    """
    transients = price_step(step).total if step is not None else 0
    need = None
    if request_rows is not None:
        cell = target.cell_bytes() + (draft.cell_bytes() if draft is not None else 0)
        need = run_need_bytes(cell, cfg.page_size, cfg.max_running_requests, request_rows,
                              transients)
    budget, rule = rank_budget(cfg, device, free_before_load, need)
    plan = plan_memory(budget, target, draft, cfg.page_size, cfg.max_total_tokens,
                       transients, rule)
    return agree_across_ranks(plan)


# ---------------------------------------------------------------- startup self-check


def _check_pool(label: str, pool, priced: int, plan: MemoryPlan) -> None:
    measured = pool.bytes_per_token()
    if measured == priced and pool.rows == plan.pool_rows:
        return
    g = pool.geometry
    state = get_parallel()
    raise PoolPricingError(
        f"{label} KV pool holds {measured:g} bytes/token but the budget priced {priced} "
        f"bytes/token (rows {pool.rows}, planned {plan.pool_rows}); the pool's terms: "
        f"kv_heads_per_rank={pool.heads_local} (num_kv_heads={g.num_kv_heads} // "
        f"attn_tp_size={state.attn_tp_size}; tp_size={state.tp_size}, "
        f"attn_dp_size={state.attn_dp_size}), head_dim={g.head_dim}, "
        f"v_head_dim={g.v_head_dim}, layers={g.num_layers}, "
        f"dtype={str(g.dtype).removeprefix('torch.')} itemsize={g.itemsize}; the plan priced "
        f"kv_heads_per_rank={_plan_heads(label, plan)} at attn_tp_size={plan.attn_tp_size}"
    )


def _plan_heads(label: str, plan: MemoryPlan) -> int:
    return plan.target_kv_heads_per_rank if label == "target" else plan.draft_kv_heads_per_rank


def model_kv_writes(model) -> list[tuple[int, int, int]]:
    """(local KV heads, k head_dim, v head_dim) per attention layer, in layer order, read
    from the model's own attention modules: what its forward will store into the pool."""
    return [(m.qkv_proj.kv_heads, m.head_dim, m.head_dim)
            for m in model.modules() if hasattr(m, "qkv_proj") and hasattr(m, "head_dim")]


def check_model_writes(label: str, pool, model) -> None:
    """The pool's per-layer buffers must be exactly what the model writes: its attention
    layers' own local KV-head count and head dims (not a second copy of the pricing)."""
    writes = model_kv_writes(model)
    holds = [(k.shape[1], k.shape[2], v.shape[2]) for k, v in zip(pool.k, pool.v)]
    if writes == holds and model.dtype == pool.geometry.dtype:
        return
    bad = next((i for i, (w, h) in enumerate(zip(writes, holds)) if w != h), None)
    where = (f"layer {bad}: the model writes (kv_heads, head_dim, v_head_dim)={writes[bad]}, "
             f"the pool holds {holds[bad]}" if bad is not None else
             f"the model has {len(writes)} attention layers, the pool {len(holds)}; dtypes "
             f"model {model.dtype} vs pool {pool.geometry.dtype}")
    raise PoolPricingError(
        f"{label} KV pool does not match what the {label} model writes into it: {where} "
        f"(attn_tp_size={get_parallel().attn_tp_size})")


def self_check(plan: MemoryPlan, target_pool, draft_pool=None, target_model=None,
               draft_model=None) -> None:
    """Measured bytes per token (real buffers) must equal the priced cell, pool by pool, and
    each pool's layers must be what its model's attention writes (when the models are given)."""
    if target_model is not None:
        check_model_writes("target", target_pool, target_model)
    if draft_model is not None and draft_pool is not None:
        check_model_writes("draft", draft_pool, draft_model)
    _check_pool("target", target_pool, plan.target_cell, plan)
    if draft_pool is None:
        if plan.draft_cell:
            raise PoolPricingError(
                f"the budget priced a draft cell of {plan.draft_cell} bytes/token but no "
                f"draft pool was built"
            )
        return
    _check_pool("draft", draft_pool, plan.draft_cell, plan)
