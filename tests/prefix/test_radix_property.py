"""Random request / insert / match / evict sequences on a KVSpace with a prefix cache.

Oracle: every pool row carries a label (position, token) written when a request "computes"
that position. A request must always read, at each of its positions, the label of its own
token there; a page freed while referenced would be handed out again and relabelled, and a
cache hit on the wrong pages would read the wrong labels. Ownership is checked as a partition:
every page is free, the cache's, or exactly one slot's.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dspark_launch.memory.allocator import KVSpace
from dspark_launch.memory.radix_cache import RadixCache

NUM_PAGES, MAX_REQ, CONTEXT = 14, 4, 24


class CachedSpaceMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.space = KVSpace(NUM_PAGES * ps, ps, MAX_REQ, CONTEXT * ps, "cpu")
        self.cache = RadixCache(self.space.allocator)
        self.space.attach_cache(self.cache)
        self.label: dict[int, tuple[int, int]] = {}  # pool row -> (position, token)
        self.running: dict[int, tuple[list[int], int]] = {}  # slot -> (tokens, kv_len)

    def _compute(self, slot: int, tokens: list[int], start: int, stop: int) -> None:
        for pos in range(start, stop):
            self.label[int(self.space.req_to_token[slot, pos])] = (pos, tokens[pos])

    # Tokens from a 2-letter alphabet in page-sized runs: prefixes collide constantly.
    @precondition(lambda self: len(self.running) < MAX_REQ)
    @rule(runs=st.lists(st.integers(0, 1), min_size=1, max_size=CONTEXT // 2),
          tail=st.integers(0, 1))
    def admit(self, runs: list[int], tail: int) -> None:
        tokens = [t for t in runs for _ in range(self.page_size)] + [tail]
        slot = self.space.new_slot()
        assert slot is not None
        hit = self.space.match_prefix(slot, tokens[:-1])  # the last token is always computed
        assert hit % self.page_size == 0 and hit < len(tokens)
        self.running[slot] = (tokens, hit)
        self._check_reads(slot)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 2 * 4))
    def grow(self, data, n: int) -> None:
        """Prefill or decode: reserve rows, compute them (write their labels)."""
        slot = data.draw(st.sampled_from(sorted(self.running)))
        tokens, kv = self.running[slot]
        stop = min(len(tokens), kv + n)
        if stop == kv:
            return
        if self.space.reserve(slot, stop):
            self._compute(slot, tokens, kv, stop)
            self.running[slot] = (tokens, stop)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def verify_then_roll_back(self, data, extra: int) -> None:
        """A verify writes rows past kv_len; they are truncated, never cached."""
        slot = data.draw(st.sampled_from(sorted(self.running)))
        tokens, kv = self.running[slot]
        if self.space.reserve(slot, kv + extra):
            for pos in range(kv, kv + extra):
                self.label[int(self.space.req_to_token[slot, pos])] = (pos, -1)  # rejected
            self.space.truncate(slot, kv)
            self.space.cache_prefix(slot, tokens[:kv])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_in_flight(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.running)))
        tokens, kv = self.running[slot]
        self.space.cache_prefix(slot, tokens[:kv])
        self._check_reads(slot)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), keep=st.booleans())
    def finish_or_preempt(self, data, keep: bool) -> None:
        slot = data.draw(st.sampled_from(sorted(self.running)))
        tokens, kv = self.running.pop(slot)
        if keep:
            self.space.cache_prefix(slot, tokens[:kv])
        self.space.free_slot(slot)

    @rule(n=st.integers(0, NUM_PAGES))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_pages
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable) and freed <= evictable

    def _check_reads(self, slot: int) -> None:
        tokens, kv = self.running[slot]
        for pos in range(kv):
            row = int(self.space.req_to_token[slot, pos])
            assert self.label.get(row) == (pos, tokens[pos]), (
                f"slot {slot} position {pos} reads row {row} labelled {self.label.get(row)}")

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for slot in self.running:
            self._check_reads(slot)

    @invariant()
    def pages_are_partitioned(self) -> None:
        alloc = self.space.allocator
        free = [p for p in range(1, alloc.num_pages + 1) if alloc._is_free[p]]
        assert len(free) == alloc.num_free_pages
        owners = list(free) + self.cache.pages()
        for slot in self.running:
            pages = self.space.slot_pages(slot)
            shared = self.space._shared[slot]
            assert set(pages[:shared]) <= set(self.cache.pages())
            owners += pages[shared:]
        assert sorted(owners) == list(range(1, alloc.num_pages + 1)), "a page owned twice or lost"
        assert self.cache.num_pages == len(self.cache.pages())

    @invariant()
    def locked_pages_are_the_running_requests(self) -> None:
        in_use = set()
        for slot in self.running:
            in_use |= set(self.space.slot_pages(slot)[:self.space._shared[slot]])
        assert self.cache.locked_pages >= len(in_use)
        if not self.running:
            assert self.cache.locked_pages == 0

    def teardown(self) -> None:
        for slot in list(self.running):
            self.space.free_slot(slot)
        self.cache.flush()
        assert self.space.is_full(), "the allocator is not full after a flush"


class CachedSpacePaged(CachedSpaceMachine):
    page_size = 4


TestCachedSpacePage1 = CachedSpaceMachine.TestCase
TestCachedSpacePage1.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
TestCachedSpacePage4 = CachedSpacePaged.TestCase
TestCachedSpacePage4.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
