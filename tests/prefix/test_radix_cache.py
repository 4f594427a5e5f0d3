"""RadixCache unit cases: match, split, insert of copies, locks, LRU eviction, flush."""

from __future__ import annotations

import pytest

from dspark_launch.memory.allocator import KVSpace, PageAllocator
from dspark_launch.memory.radix_cache import RadixCache


def cache_of(num_pages: int, page_size: int) -> RadixCache:
    return RadixCache(PageAllocator(num_pages, page_size))


def cached(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Put tokens in the cache on fresh pages; returns the pages."""
    pages = cache.allocator.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    tree_pages, _ = cache.insert(tokens, pages)
    assert tree_pages == pages
    return pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_returns_longest_whole_page_prefix(page_size: int) -> None:
    c = cache_of(64, page_size)
    a = list(range(4 * page_size))
    pages = cached(c, a)
    # Exact, longer and shorter queries.
    assert c.match(a)[0] == pages
    assert c.match(a + [99] * page_size)[0] == pages
    assert c.match(a[:2 * page_size])[0] == pages[:2]
    # A query that diverges inside page 3 matches pages 0..1 only (whole pages).
    diverge = a[:2 * page_size] + [77] + a[2 * page_size + 1:]
    assert c.match(diverge)[0] == pages[:2]
    # Less than a page, or a different first token: nothing.
    assert c.match(a[:page_size - 1])[0] == []
    assert c.match([500] + a[1:])[0] == []


def test_match_splits_an_edge_and_keeps_both_halves() -> None:
    c = cache_of(16, 2)
    a = [1, 2, 3, 4, 5, 6]
    pages = cached(c, a)
    hit, node = c.match([1, 2, 3, 4, 9, 9])
    assert hit == pages[:2] and node.key == (1, 2, 3, 4)
    (child,) = node.children.values()
    assert child.key == (5, 6) and child.pages == pages[2:] and child.parent is node
    # The whole sequence still matches through the split, with the same pages.
    assert c.match(a)[0] == pages
    assert c.num_pages == 3 and sorted(c.pages()) == sorted(pages)


def test_insert_of_a_computed_copy_returns_the_tree_pages() -> None:
    c = cache_of(16, 2)
    a = [1, 2, 3, 4]
    first = cached(c, a)
    copy = c.allocator.alloc(3)
    tree_pages, node = c.insert(a + [7, 8], copy)
    # Positions the tree held come back as the tree's pages (the copy stays the caller's);
    # the new page passes to the tree.
    assert tree_pages == first + [copy[2]]
    assert node.key == (7, 8) and c.num_pages == 3
    c.allocator.free(copy[:2])


def test_branching_inserts_share_the_common_part() -> None:
    c = cache_of(32, 1)
    pa = cached(c, [1, 2, 3, 4])
    pb_new = c.allocator.alloc(4)
    tree_pages, _ = c.insert([1, 2, 8, 9], pb_new)
    assert tree_pages[:2] == pa[:2] and tree_pages[2:] == pb_new[2:]
    c.allocator.free(pb_new[:2])
    assert c.match([1, 2, 8, 9])[0] == tree_pages
    assert c.match([1, 2, 3, 4])[0] == pa
    assert c.num_pages == 6


def test_evict_is_lru_over_leaves_and_skips_locked_paths() -> None:
    c = cache_of(32, 1)
    old = cached(c, [1, 2, 3])
    mid = cached(c, [5, 6])
    cached(c, [7, 8])
    c.match([1, 2, 3])  # touch: [1, 2, 3] is now the most recent
    _, node = c.match([5, 6])
    c.lock(node)  # [5, 6] is in use
    free0 = c.allocator.num_free_pages
    assert c.evict(1) == 2  # a whole leaf goes: the least recent unlocked one, [7, 8]
    assert c.match([7, 8])[0] == [] and c.match([1, 2, 3])[0] == old
    assert c.evict(100) == 3  # only [1, 2, 3] is left to evict; [5, 6] is locked
    assert c.match([5, 6])[0] == mid and c.allocator.num_free_pages == free0 + 5
    assert c.locked_pages == 2 and c.evictable_pages == 0
    c.unlock(node)
    c.flush()
    assert c.allocator.num_free_pages == c.allocator.num_pages


def test_evict_walks_up_to_a_parent_left_childless() -> None:
    c = cache_of(32, 1)
    cached(c, [1, 2, 3, 4])
    c.insert([1, 2, 9], [*c.match([1, 2])[0], *c.allocator.alloc(1)])
    assert c.num_pages == 5  # [1, 2] split off as a shared parent of [3, 4] and [9]
    assert c.evict(5) == 5 and c.num_pages == 0 and not c.root.children


def test_lock_counts_follow_a_split() -> None:
    c = cache_of(16, 1)
    cached(c, [1, 2, 3, 4])
    _, leaf = c.match([1, 2, 3, 4])
    c.lock(leaf)
    assert c.locked_pages == 4
    _, mid = c.match([1, 2, 7])  # splits the locked edge
    assert mid.lock_ref == 1 and leaf.parent is mid
    c.unlock(leaf)
    assert c.locked_pages == 0 and c.evictable_pages == 4
    with pytest.raises(AssertionError, match="not locked"):
        c.unlock(leaf)


def test_flush_refuses_while_pages_are_in_use() -> None:
    c = cache_of(8, 1)
    cached(c, [1, 2])
    _, node = c.match([1, 2])
    c.lock(node)
    with pytest.raises(AssertionError, match="in use"):
        c.flush()


@pytest.mark.parametrize("page_size", [1, 16])
def test_space_shares_pages_between_slots_and_frees_each_once(page_size: int) -> None:
    ps = page_size
    space = KVSpace(max_total_tokens=8 * ps, page_size=ps, max_requests=4,
                    max_context_len=8 * ps, device="cpu")
    space.attach_cache(RadixCache(space.allocator))
    prompt = list(range(3 * ps + 1))
    a = space.new_slot()
    assert space.match_prefix(a, prompt[:-1]) == 0
    assert space.reserve(a, len(prompt))
    rows_a = space.req_to_token[a, :len(prompt)].tolist()
    space.cache_prefix(a, prompt)  # 3 whole pages pass to the cache
    b = space.new_slot()
    hit = space.match_prefix(b, prompt[:-1])  # the last prompt token is always computed
    assert hit == 3 * ps == space.reserved_len(b)
    assert space.req_to_token[b, :hit].tolist() == rows_a[:hit]
    assert space.reserve(b, len(prompt))
    assert space.req_to_token[b, hit:len(prompt)].tolist() != rows_a[hit:len(prompt)]
    space.free_slot(a)
    space.free_slot(b)
    assert not space.is_full()  # the cache still holds the prefix
    space.cache.flush()
    assert space.is_full()


def test_space_evicts_cached_pages_when_an_allocation_needs_room() -> None:
    space = KVSpace(max_total_tokens=6, page_size=1, max_requests=2, max_context_len=6,
                    device="cpu")
    space.attach_cache(RadixCache(space.allocator))
    a = space.new_slot()
    assert space.reserve(a, 5)
    space.cache_prefix(a, [1, 2, 3, 4, 5])
    space.free_slot(a)
    assert space.allocator.num_free_pages == 1 and space.cache.evictable_pages == 5
    b = space.new_slot()
    assert space.can_reserve(b, 6) and space.reserve(b, 6)
    assert space.cache.num_pages == 0
    space.free_slot(b)
    assert space.is_full()


def test_space_swaps_a_copy_for_the_cached_page() -> None:
    """Two slots computed the same prefix at once: the second insert frees its copy and its
    table rows then point at the cache's pages."""
    space = KVSpace(max_total_tokens=16, page_size=2, max_requests=2, max_context_len=8,
                    device="cpu")
    space.attach_cache(RadixCache(space.allocator))
    toks = [3, 1, 4, 1, 5]
    a, b = space.new_slot(), space.new_slot()
    assert space.reserve(a, 5) and space.reserve(b, 5)
    space.cache_prefix(a, toks)
    free_before = space.allocator.num_free_pages
    space.cache_prefix(b, toks)
    assert space.allocator.num_free_pages == free_before + 2  # b's two copies
    assert space.req_to_token[b, :4].tolist() == space.req_to_token[a, :4].tolist()
    assert space.req_to_token[b, 4].item() != space.req_to_token[a, 4].item()
    space.free_slot(a)
    space.free_slot(b)
    space.cache.flush()
    assert space.is_full()
