"""`vllm_release.Releases`: a prefill worker reports a request in `finished_sending`
exactly once, after vLLM said it finished and every lease holding its blocks on the
rank was released, in whatever order those arrive within a step; and it keeps nothing
for the requests it never published (a long-running engine must not grow with every
request it served)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.integrations.vllm_release import Releases


def test_tp1_a_request_is_sent_once_released_and_finished_in_either_order() -> None:
    r = Releases(0)
    r.announce({"a": {0: ["a"]}, "b": {0: ["b"]}})
    r.released("b", 0.0)  # the decode pulled b before vLLM's next step
    assert r.sending_done({"a", "b"}, 0.0) == {"b"}
    assert r.sending_done(set(), 1.0) == set()
    r.released("a", 2.0)
    assert r.sending_done(set(), 2.0) == {"a"}
    assert r.sending_done(set(), 3.0) == set() and len(r) == 0


def test_tp2_a_request_waits_for_every_lease_on_its_rank_only() -> None:
    rank1 = Releases(1)
    published = {"q": {0: ["q~p0d0of2"], 1: ["q~p1d0of2", "q~p1d1of2"]}, "z": {0: ["z~p0d0of1"]}}
    rank1.announce(published)
    rank1.released("q~p1d1of2", 0.0)
    assert rank1.sending_done({"q", "z"}, 0.0) == {"z"}  # z holds nothing on rank 1
    rank1.released("q~p0d0of2", 1.0)  # another rank's lease never counts here
    assert rank1.sending_done(set(), 1.0) == set()
    rank1.released("q~p1d0of2", 2.0)
    assert rank1.sending_done(set(), 2.0) == {"q"}


def test_nothing_is_kept_for_requests_never_published() -> None:
    """Every finished id reaches every worker; a decode worker publishes none."""
    r = Releases(0)
    for step in range(1000):
        assert r.sending_done({f"req-{step}", f"other-{step}"}, float(step)) == set()
    assert len(r) == 0


def test_a_withdrawn_lease_nobody_announces_is_forgotten() -> None:
    r = Releases(1, unclaimed_s=60)
    r.released("w~p1d0of2", 0.0)  # the scheduler withdrew it: never announced
    r.sending_done(set(), 30.0)
    assert len(r) == 1  # still claimable: an announcement may be a step away
    r.sending_done(set(), 61.0)
    assert len(r) == 0


@settings(max_examples=200, deadline=None)
@given(
    leases=st.integers(1, 4),
    order=st.permutations(range(5)),
    finish_at=st.integers(0, 5),
)
def test_sent_exactly_once_after_the_last_release_and_the_finish(
    leases: int, order: list[int], finish_at: int
) -> None:
    """One request with `leases` leases on this rank; releases land one per step in a
    random order (index 4 and above: no lease), vLLM's finish at step `finish_at`."""
    r = Releases(0)
    ids = [f"x~p0d{d}of{leases}" for d in range(leases)]
    r.announce({"x": {0: ids}})
    releases = [ids[i] for i in order if i < leases]
    sent_at = []
    for step in range(8):
        if step < len(releases):
            r.released(releases[step], float(step))
        if r.sending_done({"x"} if step == finish_at else set(), float(step)):
            sent_at.append(step)
    assert sent_at == [max(len(releases) - 1, finish_at)]
    assert len(r) == 0


def test_a_gone_sidecar_frees_every_announced_request_and_every_later_one() -> None:
    """Its leases died with it (the worker's `_watch` says so): nothing it held can be
    read any more, so vLLM may free the blocks, once each request finished."""
    r = Releases(0)
    r.announce({"a": {0: ["a"]}, "b": {0: ["b~p0d0of2", "b~p0d1of2"]}})
    r.released("b~p0d0of2", 0.0)
    r.release_all()
    assert r.sending_done({"a"}, 1.0) == {"a"}
    r.announce({"c": {0: ["c"]}})  # published just before the sidecar went
    assert r.sending_done({"b", "c"}, 2.0) == {"b", "c"}
    assert len(r) == 0
