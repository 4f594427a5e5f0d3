"""Verify-length policy: how many drafts each request of a group verifies this step.

Algorithm 1 of the DSpark paper (reference/dspark-scheduler.md): every request verifies at
least its anchor; candidates (r, j) = "request r also verifies its draft j" are walked in order
of falling survival a_{r,j}; each is admitted while it raises the expected throughput

    theta(B) = (expected committed tokens) / (seconds of a step with B tokens in the forward)

and the walk stops at the FIRST candidate that does not raise it (early stopping). A request
may end with l_r = 0: plain decoding for it this step.

Why this is lossless (the output distribution is exactly the target's)
--------------------------------------------------------------------
Fix a request r and condition on everything that does not depend on r's drafts this step:
the past, and the other requests' drafts (drawn from their own generators, so independent of
r's draws given the past). Write x_1, x_2, ... for r's drafts and F_{j-1} = sigma(x_1..x_{j-1}).

Claim: the event {l_r >= j} is F_{j-1}-measurable, i.e. whether draft j is verified is
decided before draft j is looked at.
- a_{r,i} = prod_{i' <= i} p_{r,i'} and p_{r,i} is computed before x_i is drawn: DSpark's
  c_i reads the hidden state of the block (context only) and x_{i-1} (the Markov feature);
  DFlash/NGRAM estimates read only past rounds. So a_{r,1..j} is F_{j-1}-measurable.
- The candidates walked before (r, j) are those with a larger key (-a, r, j) (ties broken by
  request, then position). r's own candidates among them are (r, i < j) only: a_{r,i} is
  non-increasing in i (enforced by a running minimum, itself F_{j-1}-measurable), so every
  (r, i > j) sorts after (r, j). Which other requests' candidates come before (r, j) depends
  on a_{r,j} and their own values, all known given F_{j-1} and the conditioning.
- The walk reaches (r, j) and admits it iff every candidate before it improved theta and
  (r, j) improves it too: a function of the candidates up to and including (r, j) only —
  early stopping means nothing after (r, j) is ever consulted for it.
Hence l_r is a stopping time of r's draft sequence. Speculative sampling with a stopping-time
block length is exact: at position j, given drafts < j were accepted (so they equal the
committed tokens), either l_r >= j and the min(1, p/q) test with the residual resample yields
a token distributed as p, or l_r < j and the bonus token is drawn from p directly; in both
cases draft j's value never influenced whether it was tested. Greedy decoding is exact for
any length (accepted drafts equal the target's argmax). A search that looked at later
candidates and came back (a global argmax over all length vectors) would make {l_r >= j}
depend on x_j, x_{j+1}, ... — the paper's Appendix A counterexample — hence the early stop.

The same argument covers any length computed from past rounds only (the "fixed" policy, a
probe, or the DFlash/NGRAM decision to skip drafting a request this step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

POLICIES = ("adaptive", "fixed")


@dataclass(frozen=True)
class Choice:
    lengths: list[int]  # drafts verified per request (0 = plain decoding this step)
    expected_tokens: float  # predicted committed tokens: one per request + admitted survival
    tokens: int  # tokens in the forward (base + admitted drafts)


def monotone(survival: Sequence[float]) -> list[float]:
    """Running minimum clipped to [0, 1]: survival of a longer prefix is never higher."""
    out, low = [], 1.0
    for a in survival:
        low = min(low, max(0.0, float(a)))
        out.append(low)
    return out


def choose_lengths(
    survival: Sequence[Sequence[float]],  # per request a_{r,1..L_r}; L_r = drafts available
    base_tokens: int,  # tokens in the forward before any draft (prefill chunks + anchors)
    step_seconds: Callable[[int], float],  # predicted seconds of a step with n tokens
) -> Choice:
    """Algorithm 1: greedy admission by falling survival, stopping at the first candidate that
    does not raise expected committed tokens per second."""
    reqs = len(survival)
    lengths = [0] * reqs
    tau = float(reqs)  # every request commits at least its bonus token
    tokens = base_tokens
    if reqs == 0:
        return Choice(lengths, tau, tokens)
    best = tau / step_seconds(tokens)
    candidates = sorted(
        ((-a, r, j) for r, row in enumerate(survival) for j, a in enumerate(monotone(row))),
    )
    for neg_a, r, j in candidates:
        assert lengths[r] == j, "survival order must respect each request's prefix order"
        theta = (tau - neg_a) / step_seconds(tokens + 1)
        if theta <= best:
            break  # early stop: the first non-improving candidate ends the walk
        best, tau, tokens = theta, tau - neg_a, tokens + 1
        lengths[r] = j + 1
    return Choice(lengths, tau, tokens)


def fixed_lengths(limits: Sequence[int], base_tokens: int) -> Choice:
    """Today's behaviour: every available draft is verified (expected tokens unknown: NaN)."""
    return Choice(list(limits), float("nan"), base_tokens + sum(limits))
