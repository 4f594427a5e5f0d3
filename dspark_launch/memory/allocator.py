"""Page allocator and the one KV location space shared by the target and draft pools.

Row r of every pool belongs to page r // page_size. Page 0 (rows [0, page_size)) is the
padding dummy: padded tokens write there and unassigned table entries point there, so it
is never handed out. Both pools index the same rows, so one allocator serves both.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from dspark_launch.attention.metadata import upload

if TYPE_CHECKING:
    from dspark_launch.memory.radix_cache import Node, RadixCache


class Reserve(enum.Enum):
    """reserve()'s answer. Only OK is truthy, so `if space.reserve(...)` reads as before; the
    two refusals call for different actions: NO_PAGES is temporary (another request can give
    pages back: preempt or wait), TOO_LONG never succeeds (the request must end)."""

    OK = "ok"
    NO_PAGES = "out of pages"
    TOO_LONG = "longer than the context"

    def __bool__(self) -> bool:
        return self is Reserve.OK


class PageAllocator:
    """Free list over pages 1..num_pages. Out of pages is a normal answer (None)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        # Stack: pop from the end. Reversed so the first pages handed out are 1, 2, 3...
        self._free: list[int] = list(range(num_pages, 0, -1))
        self._is_free = bytearray(num_pages + 1)  # index 0 unused (the dummy page)
        for page in self._free:
            self._is_free[page] = 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, n_pages: int) -> list[int] | None:
        if n_pages < 0:
            raise ValueError(f"alloc(n_pages={n_pages}) must be >= 0")
        if n_pages > len(self._free):
            return None
        if n_pages == 0:
            return []
        pages = self._free[-n_pages:][::-1]  # ascending, so a fresh pool hands out 1, 2, ...
        del self._free[-n_pages:]
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages) -> None:
        pages = [int(p) for p in pages]
        # Validate everything first so a bad call changes nothing.
        seen: set[int] = set()
        for page in pages:
            assert page != 0, "free(page 0): page 0 is the padding dummy, never allocated"
            assert 1 <= page <= self.num_pages, (
                f"free(page {page}): outside 1..num_pages={self.num_pages}"
            )
            assert not self._is_free[page] and page not in seen, (
                f"free(page {page}): double free (page {page} is already free)"
            )
            seen.add(page)
        for page in pages:
            self._is_free[page] = 1
        self._free.extend(pages)

    def backup(self) -> object:
        """Snapshot for temporary allocations (e.g. draft slots) undone by restore()."""
        return (list(self._free), bytes(self._is_free))

    def restore(self, state) -> None:
        free, is_free = state
        self._free = list(free)
        self._is_free = bytearray(is_free)


class KVSpace:
    """req -> token table plus the page allocator: where every (slot, position) lives.

    With a prefix cache attached, a slot's first pages may be the cache's (shared with other
    requests, locked while the slot uses them): the slot never frees those, and an allocation
    that finds no free page takes other requests' spare rows, then evicts unlocked cached
    pages (_alloc).
    """

    def __init__(
        self,
        max_total_tokens: int,
        page_size: int,
        max_requests: int,
        max_context_len: int,
        device,
    ) -> None:
        num_pages = max_total_tokens // page_size
        if num_pages < 1:
            raise ValueError(
                f"max_total_tokens={max_total_tokens} is less than one page "
                f"(page_size={page_size})"
            )
        if max_requests < 1 or max_context_len < 1:
            raise ValueError(
                f"max_requests={max_requests} and max_context_len={max_context_len} must be >= 1"
            )
        self.page_size = page_size
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.allocator = PageAllocator(num_pages, page_size)
        # Rows the pools must have: the pages plus the dummy page 0.
        self.num_rows = (num_pages + 1) * page_size
        self._table = torch.zeros(
            (max_requests, max_context_len), dtype=torch.int64, device=device
        )
        # Table writes wait here (flat index, row) until the table is next read, so a step's
        # reserves and truncates of every request reach the device as one write.
        self._writes: list[tuple[np.ndarray, np.ndarray]] = []
        # Called before rows change hands (freed, or handed to the prefix cache): whoever
        # still owes those rows a write (the block drafter's deferred context) pays it now.
        self.before_release: list[Callable[[], None]] = []
        self._pages: list[list[int] | None] = [None] * max_requests  # None = slot free
        self._lens = [0] * max_requests
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self.cache: RadixCache | None = None
        self._shared = [0] * max_requests  # leading pages of the slot that the cache owns
        self._node: list[Node | None] = [None] * max_requests  # the cache path the slot locks
        # Slots that keep spare rows (roll_back()): slot -> the length it uses; its rows past
        # that are spare, reused by its next reserve and reclaimed when pages run short.
        self._spare: dict[int, int] = {}

    @property
    def req_to_token(self) -> torch.Tensor:
        """[max_requests, max_context_len] pool row of every (slot, position); reading it
        applies the pending writes first (one host->device copy and one scatter)."""
        if self._writes:
            index = np.concatenate([i for i, _ in self._writes])
            rows = np.concatenate([r for _, r in self._writes])
            self._writes = []
            # A later write to the same entry wins (reserve after truncate in one step).
            _, last = np.unique(index[::-1], return_index=True)
            keep = len(index) - 1 - last
            both = upload(np.stack([index[keep], rows[keep]]), torch.int64, self._table.device)
            self._table.view(-1).index_copy_(0, both[0], both[1])
        return self._table

    def attach_cache(self, cache: RadixCache) -> None:
        assert cache.allocator is self.allocator and self.is_full()
        self.cache = cache

    # -- slots
    def new_slot(self) -> int | None:
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self._pages[slot] = []
        self._lens[slot] = 0
        return slot

    def _check_slot(self, slot: int) -> list[int]:
        assert 0 <= slot < self.max_requests and self._pages[slot] is not None, (
            f"slot {slot} is not in use"
        )
        return self._pages[slot]  # type: ignore[return-value]

    def reserved_len(self, slot: int) -> int:
        self._check_slot(slot)
        return self._lens[slot]

    @property
    def num_free_tokens(self) -> int:
        return self.allocator.num_free_tokens

    def is_full(self) -> bool:
        """True when every page and every slot is free (nothing is held)."""
        return (
            self.allocator.num_free_pages == self.allocator.num_pages
            and len(self._free_slots) == self.max_requests
        )

    # -- reserve / truncate
    def pages_needed(self, slot: int, length: int) -> int:
        pages = self._check_slot(slot)
        want = -(-length // self.page_size)  # ceil
        return max(0, want - len(pages))

    def can_reserve(self, slot: int, length: int) -> bool:
        if length > self.max_context_len:
            return False
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        return (self.pages_needed(slot, length)
                <= self.allocator.num_free_pages + evictable + self.spare_pages(but=slot))

    def reserve(self, slot: int, length: int) -> Reserve:
        """Make rows exist for positions [0, length) (the slot's spare rows first). All or
        nothing."""
        pages = self._check_slot(slot)
        current = self._lens[slot]
        if length <= current:
            if slot in self._spare:  # spare rows back in use: no pages, no table writes
                self._spare[slot] = max(self._spare[slot], length)
                if length == current:
                    del self._spare[slot]
            return Reserve.OK
        if length > self.max_context_len:
            return Reserve.TOO_LONG
        new_pages = self._alloc(self.pages_needed(slot, length), slot)
        if new_pages is None:
            return Reserve.NO_PAGES
        self._spare.pop(slot, None)
        pages.extend(new_pages)
        # Positions [current, length) land first in the partly used last page (the
        # remainder of a page already held), then in the new pages, in order.
        self._write_rows(slot, current, length)
        self._lens[slot] = length
        return Reserve.OK

    def roll_back(self, slot: int, length: int) -> None:
        """The slot uses positions [0, length) now; its rows past them stay its own as spare
        rows, which its next reserve takes first, until an allocation that finds no free page
        reclaims them (_alloc). For a verify's rejected rows: truncated and reserved anew each
        round, at page size 1 every request's rows ended up scattered among the others', and
        a drafting engine's steps ran slower, its plain ones most (scripts/bench_spare_rows.py
        and bench_switch.py; docs/bench/HISTORY.md, round 30). Spare rows give way to any
        reservation that fits without them, so the scheduler decides exactly as if they had
        been freed (tests/spec/test_spare_rows.py)."""
        self._check_slot(slot)
        if not 0 <= length <= self._lens[slot]:
            raise ValueError(f"roll_back(slot {slot}, length={length}): expected 0..reserved "
                             f"length {self._lens[slot]}")
        assert -(-length // self.page_size) >= self._shared[slot], (
            f"roll_back(slot {slot}, length={length}) would spare pages the cache owns")
        if length < self._lens[slot]:
            self._spare[slot] = length
        else:
            self._spare.pop(slot, None)

    def spare_pages(self, but: int | None = None) -> int:
        """Pages that slots (other than `but`) hold only as spare rows: free on demand."""
        ps = self.page_size
        return sum(len(self._pages[s]) - -(-n // ps)  # type: ignore[arg-type]
                   for s, n in self._spare.items() if s != but)

    def _alloc(self, n_pages: int, slot: int) -> list[int] | None:
        """n_pages for `slot`: free pages, then other slots' spare rows (they hold nothing
        anyone will read), then unlocked cached pages (which a later prompt may hit). None,
        with nothing changed, when even all of those would not do."""
        short = n_pages - self.allocator.num_free_pages
        if short > 0:
            evictable = self.cache.evictable_pages if self.cache is not None else 0
            if short > self.spare_pages(but=slot) + evictable:
                return None
            for other, length in list(self._spare.items()):
                if other != slot and self.allocator.num_free_pages < n_pages:
                    self.truncate(other, length)
            if self.allocator.num_free_pages < n_pages:
                self.cache.evict(n_pages - self.allocator.num_free_pages)  # type: ignore[union-attr]
        return self.allocator.alloc(n_pages)

    def _write_rows(self, slot: int, start: int, stop: int) -> None:
        """req_to_token[slot, start:stop] from the slot's pages (applied at the next read).
        Only the pages these positions touch are converted: this runs every decode step."""
        ps = self.page_size
        first = start // ps
        pos = np.arange(start, stop, dtype=np.int64)
        page_ids = np.asarray(self._pages[slot][first:], dtype=np.int64)[pos // ps - first]
        self._writes.append((slot * self.max_context_len + pos, page_ids * ps + pos % ps))

    # -- prefix cache
    def match_prefix(self, slot: int, tokens: list[int]) -> int:
        """A fresh slot takes the longest cached prefix of tokens (whole pages, locked while
        the slot holds them). Returns its length in tokens (0 without a cache)."""
        pages = self._check_slot(slot)
        assert not pages, f"match_prefix: slot {slot} already holds rows"
        if self.cache is None or len(tokens) < self.page_size:
            return 0
        hit, node = self.cache.match(tokens)
        if not hit:
            return 0
        self.cache.lock(node)
        pages.extend(hit)
        self._shared[slot], self._node[slot] = len(hit), node
        self._lens[slot] = len(hit) * self.page_size
        self._write_rows(slot, 0, self._lens[slot])
        return self._lens[slot]

    def cache_prefix(self, slot: int, tokens: list[int]) -> None:
        """Hand the slot's computed whole pages to the cache; tokens are the ids at positions
        [0, computed) (both pools' K/V for them written). Where the cache already held a page
        for a position, the slot frees its copy and reads the cache's (same tokens, same
        position)."""
        pages = self._check_slot(slot)
        if self.cache is None:
            return
        n = min(len(tokens) // self.page_size, len(pages))
        shared = self._shared[slot]
        if n <= shared:
            return
        for hook in self.before_release:
            hook()
        tree_pages, node = self.cache.insert(tokens[:n * self.page_size], pages[:n])
        assert tree_pages[:shared] == pages[:shared], "the slot's cached pages moved"
        copies = [i for i in range(shared, n) if tree_pages[i] != pages[i]]
        if copies:
            self.allocator.free([pages[i] for i in copies])
            for i in copies:
                pages[i] = tree_pages[i]
            ps = self.page_size
            self._write_rows(slot, copies[0] * ps, (copies[-1] + 1) * ps)
        self.cache.lock(node)
        if self._node[slot] is not None:
            self.cache.unlock(self._node[slot])
        self._shared[slot], self._node[slot] = n, node

    def truncate(self, slot: int, length: int) -> None:
        """Keep positions [0, length); free pages wholly beyond it."""
        pages = self._check_slot(slot)
        if length < 0:
            raise ValueError(f"truncate(slot {slot}, length={length}) must be >= 0")
        if self._spare.get(slot, length) >= length:
            self._spare.pop(slot, None)  # no spare rows left past length
        if length >= self._lens[slot]:
            return
        keep = -(-length // self.page_size)
        assert keep >= self._shared[slot], (
            f"truncate(slot {slot}, length={length}) would drop pages the cache owns")
        self.allocator.free(pages[keep:])
        del pages[keep:]
        index = slot * self.max_context_len + np.arange(length, self._lens[slot], dtype=np.int64)
        self._writes.append((index, np.zeros_like(index)))  # back to the dummy row
        self._lens[slot] = length

    def free_slot(self, slot: int) -> None:
        pages = self._check_slot(slot)
        for hook in self.before_release:
            hook()
        if self._node[slot] is not None:
            # The cache's pages stay the cache's: the slot only lets go of them.
            self.cache.unlock(self._node[slot])  # type: ignore[union-attr]
            del pages[:self._shared[slot]]
            self._shared[slot], self._node[slot] = 0, None
        self.truncate(slot, 0)
        self._pages[slot] = None
        self._free_slots.append(slot)

    def slot_pages(self, slot: int) -> list[int]:
        return list(self._check_slot(slot))
