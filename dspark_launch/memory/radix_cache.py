"""Radix prefix cache: requests that share a token prefix share its KV pages.

SGLang's RadixAttention semantics, one tree per attn_dp group. Each edge of the tree is a
run of whole pages: its key is the tokens those pages hold (a multiple of page_size tokens,
always starting at a page boundary, so a prefix's K/V sits at the same positions in every
request) and its value is the page ids. The cache owns no memory of its own: its pages come
from the group's PageAllocator (inside the priced pools) and go back to it when evicted. Both
pools index the same rows, so a cached page holds the target's K/V and the draft's context
K/V for those positions at once (a request hands over only pages whose draft context was
written: Request.cacheable_ids).

Ownership: every allocated page has exactly one owner, either the tree (pages of a node) or
one request slot (its private pages). A running request that uses cached pages locks the path
from the root to the deepest node it uses (lock_ref +1 on every node of the path); a locked
node is never evicted. Unlocked leaves are evicted least recently used first when an
allocation needs room. Recency is a logical clock, not wall time, so every rank of a group
evicts the same pages in the same order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from dspark_launch.memory.allocator import PageAllocator


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "uid")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None,
                 uid: int) -> None:
        self.key = key  # tokens held by `pages`: len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}  # by the child's first page of tokens
        self.parent = parent
        self.lock_ref = 0  # running requests whose cached prefix passes through this node
        self.last_access = 0
        self.uid = uid  # creation order: breaks LRU ties identically on every rank


class RadixCache:
    """Longest-prefix match, insert, lock/unlock and LRU eviction over whole pages."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._uids = itertools.count()
        self._clock = 0
        self.root = Node((), [], None, next(self._uids))
        self.root.lock_ref = 1  # the root holds no pages and is never evicted
        self.evictable_pages = 0  # pages of unlocked nodes
        self.locked_pages = 0  # pages of nodes some running request uses
        self.evicted_pages = 0  # pages given back to make room, since the start

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def _common_pages(self, key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
        """Whole pages on which key and tokens[start:] agree."""
        ps = self.page_size
        limit = min(len(key), len(tokens) - start) // ps
        if tuple(tokens[start:start + limit * ps]) == key[:limit * ps]:
            return limit  # the common case, compared in one go
        n = 0
        while n < limit and tuple(tokens[start + n * ps:start + (n + 1) * ps]) == \
                key[n * ps:(n + 1) * ps]:
            n += 1
        return n

    # ------------------------------------------------------------------ match / insert

    def match(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """The longest cached prefix of tokens in whole pages: its pages and the deepest node
        (lock it while using the pages). A match that ends inside an edge splits it there."""
        node, pages, pos = self.root, [], 0
        now = self._tick()
        while len(tokens) - pos >= self.page_size:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)  # >= 1: the first page matched
            partial = n * self.page_size < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
            if partial:
                break
        return pages, node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[list[int], Node]:
        """Cache tokens (whole pages) held by pages. Returns the tree's pages for the whole
        prefix and its deepest node. Where the tree already held a page for a position, the
        tree's page is returned and the caller's page stays the caller's (to free if it is not
        the same page); every other page passes to the tree."""
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, (
            f"insert: {len(tokens)} tokens for {len(pages)} pages of {ps}")
        node, out, pos = self.root, [], 0
        now = self._tick()
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                leaf = Node(tuple(tokens[pos:]), list(pages[pos // ps:]), node,
                            next(self._uids))
                leaf.last_access = now
                node.children[self._page_key(tokens, pos)] = leaf
                self.evictable_pages += len(leaf.pages)
                out.extend(leaf.pages)
                return out, leaf
            n = self._common_pages(child.key, tokens, pos)
            if n * ps < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            out.extend(child.pages)
            pos += len(child.key)
            node = child
        return out, node

    def _split(self, child: Node, n_pages: int) -> Node:
        """Cut child's edge after n_pages: a new node takes the first part, child keeps the rest."""
        cut = n_pages * self.page_size
        assert 0 < cut < len(child.key)
        parent = child.parent
        assert parent is not None
        mid = Node(child.key[:cut], child.pages[:n_pages], parent, next(self._uids))
        mid.lock_ref = child.lock_ref  # every path through child passes through mid
        mid.last_access = child.last_access
        parent.children[child.key[:self.page_size]] = mid
        child.key, child.pages, child.parent = child.key[cut:], child.pages[n_pages:], mid
        mid.children[child.key[:self.page_size]] = child
        return mid

    # ------------------------------------------------------------------ references

    def lock(self, node: Node) -> None:
        """A running request uses the pages from the root to node: none of them is evicted."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
                self.evictable_pages += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction

    def evict(self, n_pages: int) -> int:
        """Give at least n_pages back to the allocator (fewer when not enough are unlocked),
        least recently used leaves first; a parent left childless becomes a candidate.
        Returns the pages freed."""
        heap = [(n.last_access, n.uid, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            self.evicted_pages += len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def flush(self) -> None:
        """Give every cached page back (no request may be using any)."""
        assert self.locked_pages == 0, f"flush with {self.locked_pages} pages in use"
        self.evict(self.evictable_pages)
        assert self.num_pages == 0 and not self.root.children

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def pages(self) -> list[int]:
        """Every page the tree holds (for checks)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.pages)
            stack.extend(node.children.values())
        return out
