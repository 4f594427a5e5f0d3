"""PageAllocator and KVSpace: exact free counts, never page/row 0, never a duplicate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dspark_launch.memory.allocator import KVSpace, PageAllocator, Reserve


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/backup/restore against a plain set model."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(num_pages=23, page_size=4)
        self.held: set[int] = set()
        self.snapshot = None

    @rule(n=st.integers(0, 9))
    def alloc_pages(self, n: int) -> None:
        got = self.alloc.alloc(n)
        free_before = 23 - len(self.held)
        if n > free_before:
            assert got is None
            return
        assert got is not None and len(got) == n and len(set(got)) == n
        assert 0 not in got and all(1 <= p <= 23 for p in got)
        assert not self.held & set(got), "a held page was handed out again"
        self.held |= set(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data) -> None:
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.alloc.free(pages)
        self.held -= set(pages)

    @rule()
    def backup(self) -> None:
        self.snapshot = (self.alloc.backup(), set(self.held))

    @precondition(lambda self: self.snapshot is not None)
    @rule()
    def restore(self) -> None:
        state, held = self.snapshot
        self.alloc.restore(state)
        self.held = set(held)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def double_free_refused(self, data) -> None:
        page = data.draw(st.sampled_from(sorted(set(range(1, 24)) - self.held) or [0]))
        with pytest.raises(AssertionError, match=f"page {page}"):
            self.alloc.free([page])

    @invariant()
    def free_count_exact(self) -> None:
        assert self.alloc.num_free_pages == 23 - len(self.held)
        assert self.alloc.num_free_tokens == (23 - len(self.held)) * 4


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("bad", [0, 6, -1])
def test_free_outside_range_names_the_page(bad: int) -> None:
    alloc = PageAllocator(5, 1)
    with pytest.raises(AssertionError, match=f"page {bad}"):
        alloc.free([bad])
    assert alloc.num_free_pages == 5


def test_out_of_pages_is_none_not_an_exception() -> None:
    alloc = PageAllocator(3, 2)
    assert alloc.alloc(3) == [1, 2, 3]
    assert alloc.alloc(1) is None
    assert alloc.num_free_tokens == 0


class SpaceMachine(RuleBasedStateMachine):
    """KVSpace reserve/roll_back/truncate/free against a model of each slot's length and of the
    length it uses (roll_back: the rows past it are spare, reclaimed when pages run short)."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = 1
        self.space: KVSpace | None = None
        self.lens: dict[int, int] = {}
        self.used: dict[int, int] = {}  # slots with spare rows -> the length they use

    def _pages(self, n: int) -> int:
        return -(-n // self.ps)

    def _spare_pages(self, but: int | None = None) -> int:
        return sum(self._pages(self.lens[s]) - self._pages(n) for s, n in self.used.items()
                   if s != but)

    @precondition(lambda self: self.space is None)
    @rule(ps=st.sampled_from([1, 16]), pages=st.integers(1, 12))
    def build(self, ps: int, pages: int) -> None:
        self.ps = ps
        self.space = KVSpace(pages * ps + ps - 1, ps, max_requests=4, max_context_len=64,
                             device="cpu")
        assert self.space.allocator.num_pages == pages
        assert self.space.num_rows == (pages + 1) * ps

    @precondition(lambda self: self.space is not None)
    @rule()
    def new_slot(self) -> None:
        slot = self.space.new_slot()
        if len(self.lens) == 4:
            assert slot is None
        else:
            assert slot is not None and slot not in self.lens
            self.lens[slot] = 0

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def reserve(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lens)))
        old_len = self.lens[slot]
        new_len = data.draw(st.integers(0, min(64, old_len + 40)))
        before = self.space.req_to_token.clone()
        free_before = self.space.allocator.num_free_pages
        need = max(0, self._pages(new_len) - self._pages(old_len))
        assert self.space.pages_needed(slot, new_len) == need
        expect = need <= free_before + self._spare_pages(but=slot)
        can = self.space.can_reserve(slot, new_len)
        answer = self.space.reserve(slot, new_len)
        ok = bool(answer)
        assert ok == can == expect
        assert answer is (Reserve.OK if ok else Reserve.NO_PAGES)  # new_len fits the context
        if not ok:  # all or nothing: no slot's rows moved, no spare row was reclaimed
            assert torch.equal(before, self.space.req_to_token)
            assert self.space.allocator.num_free_pages == free_before
            return
        table = self.space.req_to_token
        keep = min(old_len, new_len)
        assert torch.equal(table[slot, :keep], before[slot, :keep]), "reserved rows moved"
        # The partly used last page is filled first: positions stay on their page.
        if new_len > old_len and old_len % self.ps:
            last = int(before[slot, old_len - 1]) // self.ps
            fill = min(new_len, old_len - old_len % self.ps + self.ps)
            assert all(int(r) // self.ps == last for r in table[slot, old_len:fill])
        # Others lose at most their spare rows, and only when the free pages did not do.
        for other in list(self.lens):
            if other == slot:
                continue
            now = self.space.reserved_len(other)
            if now != self.lens[other]:
                assert need > free_before and other in self.used and now == self.used[other]
                self.lens[other] = now
                del self.used[other]
            assert torch.equal(table[other, :now], before[other, :now])
        if new_len > old_len:
            self.lens[slot] = new_len
            self.used.pop(slot, None)
        elif slot in self.used:  # spare rows back in use
            self.used[slot] = max(self.used[slot], new_len)
            if self.used[slot] == old_len:
                del self.used[slot]

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def roll_back(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lens)))
        length = data.draw(st.integers(0, self.lens[slot]))
        before = self.space.req_to_token.clone()
        free_before = self.space.allocator.num_free_pages
        self.space.roll_back(slot, length)
        # No page changes hands and the table is not written: the slot keeps its rows.
        assert self.space.allocator.num_free_pages == free_before
        assert torch.equal(before, self.space.req_to_token)
        if length < self.lens[slot]:
            self.used[slot] = length
        else:
            self.used.pop(slot, None)

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def roll_back_past_the_reservation_is_refused(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lens)))
        with pytest.raises(ValueError, match=f"length={self.lens[slot] + 1}"):
            self.space.roll_back(slot, self.lens[slot] + 1)

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lens)))
        keep = data.draw(st.integers(0, self.lens[slot]))
        self.space.truncate(slot, keep)
        if keep < self.lens[slot]:
            assert int(self.space.req_to_token[slot, keep:].abs().sum()) == 0
        self.lens[slot] = keep
        if self.used.get(slot, keep) >= keep:
            self.used.pop(slot, None)

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free_slot(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lens)))
        self.space.free_slot(slot)
        del self.lens[slot]
        self.used.pop(slot, None)

    @invariant()
    def rows_unique_and_never_dummy(self) -> None:
        if self.space is None:
            return
        rows, held_pages = [], 0
        for slot, n in self.lens.items():
            assert self.space.reserved_len(slot) == n
            got = self.space.req_to_token[slot, :n].tolist()
            assert all(r >= self.ps for r in got), "a row of the dummy page was handed out"
            assert all(r % self.ps == p % self.ps for p, r in enumerate(got))
            rows += got
            held_pages += self._pages(n)
        assert len(rows) == len(set(rows)), "a row was handed out twice"
        assert self.space.allocator.num_free_pages == self.space.allocator.num_pages - held_pages
        assert self.space.spare_pages() == self._spare_pages()
        assert self.space.is_full() == (not self.lens)

    def teardown(self) -> None:
        if self.space is not None:
            for slot in list(self.lens):
                self.space.free_slot(slot)
            assert self.space.is_full()


TestSpaceMachine = SpaceMachine.TestCase
TestSpaceMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("ps", [1, 16])
def test_partly_used_last_page_is_filled_first(ps: int) -> None:
    space = KVSpace(8 * ps, ps, max_requests=2, max_context_len=10 * ps, device="cpu")
    a, b = space.new_slot(), space.new_slot()
    assert space.reserve(a, 3) and space.reserve(b, 1) and space.reserve(a, ps + 2)
    rows = space.req_to_token[a, : ps + 2].tolist()
    assert 0 not in rows
    pages = [r // ps for r in rows]
    assert pages[:ps] == [pages[0]] * ps  # first page completed before a new one opened
    assert space.pages_needed(a, ps + 2) == 0
    space.truncate(a, 1)
    assert space.req_to_token[a, 1:].abs().sum() == 0
    space.free_slot(a)
    space.free_slot(b)
    assert space.is_full() and space.num_free_tokens == 8 * ps


def test_reserve_is_all_or_nothing_when_pages_run_out() -> None:
    space = KVSpace(4 * 16, 16, max_requests=2, max_context_len=200, device="cpu")
    a = space.new_slot()
    assert space.reserve(a, 20)
    assert not space.can_reserve(a, 100) and not space.reserve(a, 100)
    assert space.reserved_len(a) == 20 and space.allocator.num_free_pages == 2
    assert int(space.req_to_token[a, 20:].abs().sum()) == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_spare_rows_are_reused_then_reclaimed_before_anything_fails(ps: int) -> None:
    """A verify's rejected rows, rolled back: the slot's next round gets the same rows back
    without a page changing hands; another slot short of pages takes them (a slot's spare
    rows all at once, from as few slots as it needs) before it is refused; a reservation
    they cannot cover takes nothing."""
    space = KVSpace(6 * ps, ps, max_requests=3, max_context_len=12 * ps, device="cpu")
    a, b, c = space.new_slot(), space.new_slot(), space.new_slot()
    assert space.reserve(a, 4 * ps)
    rows = space.req_to_token[a, :4 * ps].clone()
    space.roll_back(a, ps)  # 3 spare pages
    assert space.spare_pages() == 3 and space.spare_pages(but=a) == 0
    assert space.allocator.num_free_pages == 2 and space.reserved_len(a) == 4 * ps
    assert space.reserve(a, 3 * ps)  # a round of its own: the same rows, no new page
    assert torch.equal(space.req_to_token[a, :4 * ps], rows)
    assert space.allocator.num_free_pages == 2 and space.spare_pages() == 1
    assert space.reserve(a, 2 * ps) and space.spare_pages() == 1  # still using 3 pages
    space.roll_back(a, ps)
    # c needs 3 pages, 2 are free: a's spare rows go back, all three pages.
    assert space.can_reserve(c, 3 * ps) and not space.can_reserve(c, 6 * ps)
    assert space.reserve(c, 3 * ps)
    assert space.reserved_len(a) == ps and space.spare_pages() == 0
    assert torch.equal(space.req_to_token[a, :ps], rows[:ps])
    assert int(space.req_to_token[a, ps:].abs().sum()) == 0
    assert space.allocator.num_free_pages == 2
    assert space.reserve(b, 2 * ps) and space.allocator.num_free_pages == 0
    # Nothing is spare: a is refused, and nothing changed hands.
    table = space.req_to_token.clone()
    assert space.reserve(a, ps + 1) is Reserve.NO_PAGES
    assert torch.equal(space.req_to_token, table)
    # More than every spare row would give: refused without reclaiming any.
    space.roll_back(c, ps)  # c keeps 2 spare pages; a needs 3 more pages
    assert space.spare_pages() == 2 and not space.can_reserve(a, 4 * ps)
    assert space.reserve(a, 4 * ps) is Reserve.NO_PAGES
    assert space.reserved_len(c) == 3 * ps and space.spare_pages() == 2
    assert torch.equal(space.req_to_token, table)
    for slot in (a, b, c):
        space.free_slot(slot)
    assert space.is_full() and space.spare_pages() == 0


def test_reserve_says_why_it_refused() -> None:
    """Out of pages (temporary) and longer than the context (permanent) are different answers;
    neither changes what the slot holds."""
    space = KVSpace(max_total_tokens=32, page_size=4, max_requests=2, max_context_len=24,
                    device="cpu")
    a, b = space.new_slot(), space.new_slot()
    assert space.reserve(a, 20) is Reserve.OK
    assert space.reserve(b, 16) is Reserve.NO_PAGES  # 2 pages left, 4 needed
    assert space.reserve(a, 25) is Reserve.TOO_LONG  # even though nothing else would be needed
    assert space.reserve(b, 12) is Reserve.OK
    assert space.reserve(a, 24) is Reserve.NO_PAGES  # within the context, but no page left
    assert (space.reserved_len(a), space.reserved_len(b)) == (20, 12)
    assert space.allocator.num_free_pages == 0
    assert not Reserve.NO_PAGES and not Reserve.TOO_LONG and Reserve.OK
