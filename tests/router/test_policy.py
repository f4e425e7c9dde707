"""Routing policies: prefix weighs the tokens to compute against load; ties go to the least loaded."""

import pytest

from prefixcache.router.policy import Candidate, LeastLoad, PrefixAware, RoundRobin, make_policy


def cand(name, cached=0, load=0, requests=0, prompt=1000):
    return Candidate(name, prompt, cached, load, requests)


def test_prefix_picks_the_longest_cached_prefix():
    policy = PrefixAware(weight=1.0)
    assert policy.choose([cand("a", cached=0), cand("b", cached=512), cand("c", cached=256)]).name == "b"


def test_load_outweighs_a_small_hit():
    policy = PrefixAware(weight=1.0)
    # b saves 512 tokens but has 600 tokens in flight: cost 488 + 600 > 1000 + 0.
    assert policy.choose([cand("a"), cand("b", cached=512, load=600)]).name == "a"
    # with a heavier weight the hit wins: 10 * 488 + 600 < 10 * 1000.
    assert PrefixAware(weight=10.0).choose([cand("a"), cand("b", cached=512, load=600)]).name == "b"


def test_ties_go_to_the_least_loaded_then_the_fewest_requests_then_in_turn():
    policy = PrefixAware(weight=1.0)
    # equal cost (b holds 100 more tokens but has 100 more in flight): the less loaded wins
    assert policy.choose([cand("a", cached=100, load=200), cand("b", cached=0, load=100)]).name == "b"
    assert policy.choose([cand("a", requests=3), cand("b", requests=1)]).name == "b"
    picks = {policy.choose([cand("a"), cand("b")]).name for _ in range(4)}
    assert picks == {"a", "b"}


def test_round_robin_takes_turns_and_least_load_takes_the_lightest():
    rr = RoundRobin()
    names = [rr.choose([cand("a"), cand("b"), cand("c")]).name for _ in range(6)]
    assert sorted(names) == ["a", "a", "b", "b", "c", "c"]
    assert LeastLoad().choose([cand("a", cached=999, load=5), cand("b", load=1)]).name == "b"


def test_bad_policy_settings_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="weight"):
        PrefixAware(weight=-1)


def test_a_tie_of_cost_goes_to_the_backend_holding_the_hit_retained_before_the_less_loaded():
    policy = PrefixAware(weight=1.0)
    plain = Candidate("plain", 1000, 512, 0, 0)
    retained = Candidate("retained", 1000, 512, 0, 0, retained_tokens=256)
    assert {policy.choose([plain, retained]).name for _ in range(4)} == {"retained"}
    busier = Candidate("busier", 1000, 612, 100, 0, retained_tokens=512)  # same cost, 100 tokens more in flight
    assert policy.choose([plain, busier]).name == "busier"
    assert policy.choose([plain, Candidate("far", 1000, 256, 0, 0, retained_tokens=256)]).name == "plain"
