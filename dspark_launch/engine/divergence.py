"""Ranks of one attn_tp group must commit identical tokens; the first step they do not is a
named error, not a hang.

The ranks of a group hold the same requests and run the same scheduler on the same tokens, so
their collectives match only while their commits agree. A rank that commits something else
(a nondeterministic kernel, different weights on one node, a bit flip) would next schedule a
different plan and wait in a collective its peers never join, until --dist-timeout. Instead,
each rank carries a digest of the tokens it committed in the previous step in the step's
existing all-gather (one int more); every rank compares the digests of each group, and on a
difference all ranks exchange the commits themselves to name the requests.
"""

from __future__ import annotations

import hashlib
from array import array

from dspark_launch.comm import all_gather_object
from dspark_launch.errors import RuntimeFailure
from dspark_launch.failure import fault_wanted
from dspark_launch.parallel import get_parallel

Commits = dict[str, list[int]]  # request id -> the tokens it committed in one step


class Diverged(RuntimeFailure):
    """Raised alike on every rank (from gathered data), so rank 0 alone reports it."""

    agreed = True


def committed_tokens(requests: list, lengths_before: list[int]) -> Commits:
    """What each request of this step committed (output tokens past its length before)."""
    return {r.spec.rid: r.output_ids[n:] for r, n in zip(requests, lengths_before)
            if len(r.output_ids) > n}


def commits_digest(commits: Commits) -> int:
    """A signed 63-bit digest (fits the int64 all-gather) of one step's commits; 0 for none."""
    if not commits:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for rid in sorted(commits):
        h.update(rid.encode() + b"\0")
        h.update(array("q", [len(commits[rid]), *commits[rid]]).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True) >> 1


def attn_tp_groups() -> list[list[int]]:
    """Global ranks of each attention-TP group: contiguous runs of attn_tp_size ranks."""
    s = get_parallel()
    return [list(range(g * s.attn_tp_size, (g + 1) * s.attn_tp_size))
            for g in range(s.world_size // s.attn_tp_size)]


def check_commits(digests: list[int], step: int, commits: Commits) -> None:
    """digests[r]: rank r's commits_digest for `step`, gathered. Raises Diverged on every rank
    the first time two ranks of a group differ (one extra collective, only then)."""
    split = [g for g in attn_tp_groups() if len({digests[r] for r in g}) > 1]
    if not split:
        return
    everyone: list[Commits] = all_gather_object(commits)
    group = split[0]
    first = group[0]
    rids = sorted({rid for r in group for rid in everyone[r]
                   if any(everyone[r].get(rid) != everyone[o].get(rid) for o in group)})
    shown = rids[0] if rids else None
    detail = ", ".join(f"rank {r} {everyone[r].get(shown)}" for r in group
                       if r == first or everyone[r].get(shown) != everyone[first].get(shown))
    raise Diverged(
        f"ranks {group} of one attn_tp group committed different tokens at step {step}: "
        f"request(s) {rids} (request {shown!r}: {detail}); the ranks of a group must run "
        f"the same weights, inputs and kernels")


def inject_divergence(rank: int, step: int, requests: list, lengths_before: list[int]) -> None:
    """Test hook DSPARK_FAULT=RANK:STEP:diverge: change the last token this rank committed at
    that step (the first request that committed one), as a faulty rank would."""
    if fault_wanted(rank, step) != "diverge":
        return
    for req, n in zip(requests, lengths_before):
        if len(req.output_ids) > n:
            req.output_ids[-1] += 1
            return
