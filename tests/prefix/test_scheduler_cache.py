"""The scheduler with a prefix cache, step by step without a model: what admission takes from
the cache, what is cached after a prefill chunk, at preemption and at the end, and when a
request waits for a shared prefix still in prefill. The engine's commit is played by hand
(kv_len advances by what the plan computed)."""

from __future__ import annotations

from dspark_launch.engine.request import Request, RequestSpec
from dspark_launch.engine.scheduler import SHARED_PREFILL_WAIT, Scheduler
from dspark_launch.memory.allocator import KVSpace
from dspark_launch.memory.radix_cache import RadixCache


def make(rows: int = 256, page: int = 1, chunk: int = 512, cache: bool = True
         ) -> Scheduler:
    space = KVSpace(rows, page, max_requests=8, max_context_len=rows, device="cpu")
    if cache:
        space.attach_cache(RadixCache(space.allocator))
    return Scheduler([], space, max_running=8, chunk_size=chunk, round_rows=lambda r: 4)


def request(index: int, prompt: list[int]) -> Request:
    return Request(RequestSpec(index, f"r{index}", tuple(prompt)), arrival=0.0, key=index)


def commit(plan) -> None:
    """What the engine does after the forward: prefill positions are now in the pools, and a
    completed prompt gets its first token."""
    for req, n in plan.prefill:
        req.kv_len += n
        if req.kv_len == req.fill_len and not req.output_ids:
            req.output_ids.append(7)


PREFIX = list(range(10, 10 + 2 * SHARED_PREFILL_WAIT))


def test_a_request_sharing_a_prompt_in_prefill_waits_then_hits() -> None:
    s = make()
    a, b = request(0, PREFIX + [1, 2]), request(1, PREFIX + [3, 4])
    s.waiting.extend([a, b])
    plan = s.schedule()
    assert plan.prefill == [(a, len(a.fill_ids))] and list(s.waiting) == [b]  # b waits
    commit(plan)
    plan = s.schedule()  # a's prompt is cached at the start of this step
    assert plan.prefill == [(b, 2)] and plan.decode == [a]
    assert (b.kv_len, b.cached_tokens, b.prefill_tokens) == (len(PREFIX), len(PREFIX), 2)
    # b reads a's rows for the shared prefix, its own for the rest.
    t = s.space.req_to_token
    assert t[b.slot, :len(PREFIX)].tolist() == t[a.slot, :len(PREFIX)].tolist()
    assert t[b.slot, len(PREFIX)].item() != t[a.slot, len(PREFIX)].item()


def test_without_a_cache_nobody_waits_and_nothing_is_cached() -> None:
    s = make(cache=False)
    a, b = request(0, PREFIX + [1]), request(1, PREFIX + [2])
    s.waiting.extend([a, b])
    plan = s.schedule()
    assert [r for r, _ in plan.prefill] == [a, b] and b.cached_tokens == 0


def test_prefill_chunks_are_cached_in_flight() -> None:
    s = make(chunk=24)
    prompt = list(range(100, 140))
    a = request(0, prompt)
    s.waiting.append(a)
    commit(s.schedule())  # 24 of 40 computed
    b = request(1, prompt[:20] + [5, 6, 7])  # shares 20 with a's computed part
    s.waiting.append(b)
    plan = s.schedule()  # caches a's 24 first: b hits 20 while a finishes its prompt
    assert plan.prefill == [(a, 16), (b, 3)]
    assert b.cached_tokens == 20 and b.kv_len == 20
    assert s.space.cache.num_pages == 24


def test_a_preempted_prefix_stays_cached_and_readmission_hits_it() -> None:
    s = make()
    a = request(0, list(range(50, 70)))
    s.waiting.append(a)
    commit(s.schedule())
    commit(s.schedule())  # a decodes: round rows reserved past kv_len
    assert a.decoding and a.kv_len == 20
    s.preempt(a)
    assert a.kv_len == 0 and a.slot is None
    assert s.space.cache.evictable_pages == 20 and s.space.cache.locked_pages == 0
    plan = s.schedule()
    # fill_ids = the prompt (the first output is the anchor): its last token is computed.
    assert plan.prefill == [(a, 1)] and a.cached_tokens == 19 and a.preemptions == 1


def test_cached_prompt_tokens_are_the_first_admissions_hit() -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens and the Prometheus counter report
    cached_prompt_tokens: what the cache served of the prompt. A readmission after a
    preemption hits the request's own prompt and answer too (cached_tokens: recomputation
    saved, the job's hit rate), which were reported as cached prompt tokens (a 46-token
    prompt had 126)."""
    s = make()
    a = request(0, list(range(50, 70)))  # 20 tokens
    s.waiting.append(a)
    commit(s.schedule())
    b = request(1, list(range(50, 70)) + [1])
    s.waiting.append(b)
    s.schedule()  # a's prompt is cached at the start of this step: b hits all of it
    assert (b.cached_tokens, b.cached_prompt_tokens) == (20, 20)
    a.output_ids += [8, 9, 10, 11, 12]  # 6 outputs; the last is the anchor
    a.kv_len = 25
    s.space.reserve(a.slot, a.kv_len)
    s.preempt(a)
    s.schedule()  # refills prompt + outputs but the anchor; all but the last are cached
    assert (a.cached_tokens, a.cached_prompt_tokens) == (24, 0)


def test_finish_caches_prompt_and_output_for_a_second_turn() -> None:
    s = make(page=4)
    a = request(0, list(range(1, 19)))  # 18 tokens
    s.waiting.append(a)
    commit(s.schedule())
    a.output_ids += [8, 9, 10, 11]  # committed by decode rounds; K/V up to kv_len
    a.kv_len = 18 + 4  # prompt + the first 4 outputs' positions (the last one is the anchor)
    s.space.reserve(a.slot, a.kv_len)
    s.finish(a)
    assert s.space.cache.num_pages == 5  # 22 computed positions: 5 whole pages of 4
    b = request(1, a.all_ids + [3, 3, 3])
    s.waiting.append(b)
    s.schedule()
    assert b.cached_tokens == 20  # whole pages only; the rest is computed
    s.finish(b)
    s.space.cache.flush()
    assert s.space.is_full()
