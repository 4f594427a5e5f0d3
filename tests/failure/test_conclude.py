"""Every rank decides its ending from the same roll call: who speaks, what, which exit code.
Expected lines and codes written out by hand for each mix of verdicts."""

from __future__ import annotations

import pytest

from dspark_launch.failure import BROKEN, FAILED, conclude, config_verdict, progress, signal_verdict


@pytest.fixture(autouse=True)
def _loading():
    before = (progress.phase, progress.step)
    progress.phase, progress.step = "loading", 0
    yield
    progress.phase, progress.step = before


def _all(answers: dict[int, str], world: int = 4) -> list[tuple[int, bool, str]]:
    out = []
    for rank in answers:
        end = conclude(rank, world, answers, "noticed")
        out.append((end.exit_code, end.speak, end.line))
    return out


def test_error_every_rank_shares_is_said_once_by_rank_0() -> None:
    ends = _all({r: config_verdict("bad flag") for r in range(4)})
    assert ends == [(2, True, "bad flag")] + [(2, False, "bad flag")] * 3


def test_error_one_rank_sees_is_said_by_that_rank_in_its_words() -> None:
    answers = {0: BROKEN, 1: BROKEN, 2: config_verdict("budget too small"), 3: BROKEN}
    ends = _all(answers)
    assert [e[0] for e in ends] == [2, 2, 2, 2]
    assert [(e[1], e[2]) for e in ends if e[1]] == [(True, "on rank(s) [2]: budget too small")]


def test_different_errors_are_each_said_by_their_lowest_rank() -> None:
    answers = {0: BROKEN, 1: config_verdict("A"), 2: config_verdict("B"), 3: config_verdict("A")}
    spoken = [e[2] for e in _all(answers) if e[1]]
    assert spoken == ["on rank(s) [1, 3]: A", "on rank(s) [2]: B"]


def test_a_signal_outranks_everything_and_rank_0_says_it() -> None:
    answers = {0: BROKEN, 1: signal_verdict(15), 2: config_verdict("A"), 3: FAILED}
    ends = _all(answers)
    assert [e[0] for e in ends] == [143] * 4
    assert [e[1] for e in ends] == [True, False, False, False]
    assert ends[0][2] == "interrupted by SIGTERM; stopped during loading, before any request ran"


def test_own_failure_is_followed_silently() -> None:
    ends = _all({0: BROKEN, 1: FAILED, 3: BROKEN})
    assert [(e[0], e[1]) for e in ends] == [(1, False)] * 3


def test_dead_rank_is_named_by_the_lowest_survivor() -> None:
    ends = _all({1: BROKEN, 3: BROKEN})
    assert ends[0] == (1, True, "rank(s) [0, 2] of 4 stopped answering during loading "
                                "(noticed by rank 1: noticed)")
    assert ends[1][:2] == (1, False)


def test_the_reason_a_client_is_told_leaves_out_what_the_rank_noticed() -> None:
    """A server answers its open requests with the reason: the line without gloo's socket
    text (what this rank noticed); every other line is its own reason."""
    dead = conclude(1, 4, {1: BROKEN, 3: BROKEN}, "Connection closed by peer [::1]:4242")
    assert dead.reason == "rank(s) [0, 2] of 4 stopped answering during loading"
    for answers in ({r: config_verdict("bad flag") for r in range(4)},
                    {0: BROKEN, 1: signal_verdict(15), 2: BROKEN, 3: BROKEN},
                    {0: BROKEN, 1: FAILED, 3: BROKEN}):
        end = conclude(0, 4, answers, "noticed")
        assert end.reason == end.line


def test_a_signal_after_a_peers_ending_follows_it_out() -> None:
    """torchrun signals the survivors of a rank that exited: a rank signalled once a peer had
    posted its ending (a configuration error, its own failure, a broken collective) follows
    it silently, and the job ends as the peer's verdict says; with nothing posted, or only
    signals, a signal is a signal. (A failure's traceback was followed by "interrupted by
    SIGTERM", and a timed-out peer's "stopped answering" line by a second one.)"""
    from dspark_launch.failure import FOLLOWED, signal_or_follow

    assert signal_or_follow(15, {2: config_verdict("budget too small")}) == FOLLOWED
    assert signal_or_follow(15, {}) == signal_verdict(15)
    assert signal_or_follow(15, {1: signal_verdict(15)}) == signal_verdict(15)
    assert signal_or_follow(15, {1: FAILED}) == signal_or_follow(15, {1: BROKEN}) == FOLLOWED
    answers = {0: signal_or_follow(15, {2: config_verdict("budget too small")}), 1: BROKEN,
               2: config_verdict("budget too small"), 3: BROKEN}
    ends = _all(answers)
    assert [e[0] for e in ends] == [2, 2, 2, 2]
    assert [(e[1], e[2]) for e in ends if e[1]] == [(True, "on rank(s) [2]: budget too small")]
    # A peer failed on its own (its traceback is out): everyone exits 1, nobody speaks.
    ends = _all({0: FOLLOWED, 1: FAILED})
    assert [e[0] for e in ends] == [1, 1] and not any(e[1] for e in ends)
    # Rank 1 timed out waiting for rank 0 and named it; rank 0, signalled after, is silent.
    assert conclude(0, 2, {0: FOLLOWED, 1: BROKEN}).speak is False
    assert conclude(1, 2, {1: BROKEN}).line.startswith("rank(s) [0] of 2 stopped answering")


def test_posted_verdicts_reads_what_ranks_posted_in_a_real_store() -> None:
    import torch.distributed as dist

    from dspark_launch.failure import VERDICT_KEY, posted_verdicts

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    assert posted_verdicts(store, 4) == {}
    store.set(f"{VERDICT_KEY}/2", config_verdict("A"))
    store.set(f"{VERDICT_KEY}/0", BROKEN)
    assert posted_verdicts(store, 4) == {0: BROKEN, 2: config_verdict("A")}
    assert posted_verdicts(store, 4, skip={0}) == {2: config_verdict("A")}


def test_a_follower_of_a_config_error_tells_that_error() -> None:
    """Its reason (what a server's client is told) was "on rank(s) []: d": the follower's
    own verdict sliced as if it were the error."""
    from dspark_launch.failure import FOLLOWED

    end = conclude(0, 2, {0: FOLLOWED, 1: config_verdict("budget too small")})
    assert (end.exit_code, end.speak, end.reason) == (2, False,
                                                      "on rank(s) [1]: budget too small")


def test_sighup_is_handled_unless_inherited_ignored() -> None:
    """SIGHUP and SIGQUIT stop a job or a server like SIGTERM (the server drains: its loop
    installs the same signals), but a process started under nohup keeps ignoring SIGHUP:
    the job ran on when its terminal closed, and must. In fresh interpreters (the handlers
    are process-wide)."""
    import subprocess
    import sys

    code = ("import signal\n{pre}"
            "from dspark_launch.failure import install_signal_handlers\n"
            "from dspark_launch.serve.loop import _on_signal, install_serve_signal_handlers\n"
            "install_signal_handlers()\n"
            "job = signal.getsignal(signal.SIGHUP)\n"
            "install_serve_signal_handlers()\n"
            "print(job is signal.SIG_IGN, signal.getsignal(signal.SIGHUP) is _on_signal,"
            " signal.getsignal(signal.SIGQUIT) is _on_signal)\n")
    for pre, want in (("", "False True True"),
                      ("signal.signal(signal.SIGHUP, signal.SIG_IGN)\n", "True False True")):
        out = subprocess.run([sys.executable, "-c", code.format(pre=pre)], capture_output=True,
                             text=True, timeout=60)
        assert out.stdout.split() == want.split(), out.stderr[-2000:]
