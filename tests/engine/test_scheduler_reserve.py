"""The scheduler acts on why a reservation failed: out of pages preempts the youngest running
request (it is recomputed later); a round longer than the context ends the request with
finish_reason "context_length" and takes nothing from the others."""

from __future__ import annotations

from dspark_launch.engine.params import SamplingParams
from dspark_launch.engine.request import Request, RequestSpec, Status
from dspark_launch.engine.scheduler import Scheduler
from dspark_launch.memory.allocator import KVSpace


def _decoding(n: int, prompt_len: int, rounds: int, pages: int, context: int, slots: int = 0
              ) -> tuple[Scheduler, list[Request]]:
    """n requests admitted, prefilled and holding their first token, as the engine leaves them."""
    space = KVSpace(pages, 1, max_requests=max(n, slots), max_context_len=context, device="cpu")
    reqs = [Request(RequestSpec(i, str(i), tuple(range(2, 2 + prompt_len)),
                                SamplingParams(max_tokens=100, temperature=0.0)), 0.0, i)
            for i in range(n)]
    sched = Scheduler(reqs, space, max_running=n, chunk_size=1000, round_rows=lambda r: rounds)
    plan = sched.schedule()
    assert [r for r, _ in plan.prefill] == reqs
    for req in reqs:
        req.kv_len = prompt_len
        req.output_ids.append(7)
    return sched, reqs


def test_out_of_pages_preempts_the_youngest() -> None:
    # 2 prompts of 4 rows hold 8 of 12 rows; two rounds of 4 more need 16: one must yield.
    sched, (old, young) = _decoding(2, prompt_len=4, rounds=4, pages=12, context=100)
    plan = sched.schedule()
    assert plan.decode == [old] and not plan.prefill  # no re-admission in a preempting step
    assert young.status is Status.WAITING and young.preemptions == 1 and young.slot is None
    assert old.finish_reason is None and young.finish_reason is None
    assert sched.take_ended() == []


def test_round_past_the_context_ends_the_request_without_preempting() -> None:
    # Plenty of pages, but the first request's round reaches past the space's context.
    sched, (a, b) = _decoding(2, prompt_len=4, rounds=4, pages=64, context=8)
    a.kv_len = 5  # a round from 5 needs rows up to 9 > 8
    a.output_ids.append(8)
    plan = sched.schedule()
    assert plan.decode == [b]
    assert a.status is Status.FINISHED and a.finish_reason == "context_length"
    assert a.slot is None and a.preemptions == 0 and b.preemptions == 0
    assert sched.take_ended() == [a] and sched.take_ended() == []
    assert sched.running == [b]


def test_prompt_longer_than_the_context_ends_at_admission() -> None:
    space = KVSpace(64, 1, max_requests=2, max_context_len=8, device="cpu")
    long, short = (Request(RequestSpec(i, str(i), tuple(range(2, 2 + n)),
                                       SamplingParams(max_tokens=4, temperature=0.0)), 0.0, i)
                   for i, n in enumerate((9, 3)))
    sched = Scheduler([long, short], space, 2, 1000, round_rows=lambda r: 2)
    plan = sched.schedule()
    assert [r for r, _ in plan.prefill] == [short]  # the queue does not wait behind it
    assert long.finish_reason == "context_length" and sched.take_ended() == [long]
    assert space.num_free_tokens == 64 - 3


def test_unmixed_steps_prefill_alone_then_decode() -> None:
    """disable_mixed_chunk: a step with a prefill chunk to run decodes nothing (SGLang's
    prefill-first default); decodes resume once nothing can prefill. Mixed (the default):
    the newcomer's chunk rides along with the decodes."""
    for mixed in (False, True):
        sched, reqs = _decoding(2, prompt_len=4, rounds=1, pages=64, context=100, slots=3)
        sched.mixed = mixed
        newcomer = Request(RequestSpec(9, "9", (2, 3, 4), SamplingParams(max_tokens=4)), 0.0, 9)
        sched.waiting.append(newcomer)
        sched.max_running = 3
        plan = sched.schedule()
        assert [r for r, _ in plan.prefill] == [newcomer]
        assert plan.decode == (reqs if mixed else [])
        newcomer.kv_len = 3
        newcomer.output_ids.append(7)
        plan = sched.schedule()
        assert not plan.prefill and plan.decode == [*reqs, newcomer]
