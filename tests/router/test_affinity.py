"""Affinity: prompt_cache_key (or a prompt's first blocks) keeps requests on one backend when no cached prefix
decides, within a bound on load; router replicas agree on it without talking to each other."""

from concurrent.futures import ThreadPoolExecutor

from prefixcache.router.policy import Candidate, PrefixAware
from tests.helpers import wait_until
from tests.router.fakes import complete, index_blocks, served_by


def test_one_key_goes_to_one_backend_and_keys_spread(vllm, router):
    backends = [vllm(name) for name in "abc"]
    r = router(backends)  # no events anywhere: affinity and load alone
    homes = {}
    for key in range(24):
        requests = [complete(r, prompt=[key % 3] * 9, prompt_cache_key=f"conversation-{key}") for _ in range(3)]
        landed = {served_by(response) for response in requests}
        assert len(landed) == 1  # whatever its prompt, one key's requests follow one backend
        homes[key] = landed.pop()
    assert set(homes.values()) == {b.url for b in backends}  # and the keys spread over all of them


def test_a_busy_keys_backend_keeps_it_only_within_the_bound(vllm, router):
    a, b = vllm("a"), vllm("b")
    r = router([a, b])
    home = served_by(complete(r, prompt_cache_key="hot"))
    a.proceed.clear()
    b.proceed.clear()
    with ThreadPoolExecutor(10) as clients:
        futures = []
        for n in range(1, 11):
            futures.append(clients.submit(complete, r, prompt_cache_key="hot"))
            wait_until(lambda n=n: len(a.received) + len(b.received) == n + 1, what=f"request {n} at a backend")
        counts = {x.url: len(x.received) for x in (a, b)}
        counts[home] -= 1  # the first request, before the burst
        # 10 requests in flight, bound 1.25: the key's backend holds at most ceil(1.25 * 10 / 2) = 7 of them
        assert counts[home] == 7 and sum(counts.values()) == 10
        a.proceed.set()
        b.proceed.set()
        assert all(f.result().status_code == 200 for f in futures)
    assert served_by(complete(r, prompt_cache_key="hot")) == home  # idle again: back home


def test_bounded_affinity_follows_the_order_until_the_bound():
    policy = PrefixAware(weight=1.0, affinity_balance=1.5)

    def pick(a_requests, b_requests, cached_b=0):
        candidates = [Candidate("a", 100, 0, 0, a_requests, 1), Candidate("b", 100, cached_b, 0, b_requests, 0)]
        return policy.choose(candidates).name

    assert pick(0, 0) == "b"  # first in the key's order
    assert pick(0, 2) == "b"  # 3 <= ceil(1.5 * 3 / 2)
    assert pick(0, 3) == "a"  # 4 > ceil(1.5 * 4 / 2)
    assert pick(5, 0, cached_b=0) == "b"
    assert pick(0, 9, cached_b=50) == "b"  # a cached prefix decides by cost, not by the bound
    assert (
        PrefixAware(weight=1.0, affinity_balance=0)
        .choose([Candidate("a", 100, 0, 0, 0, 1), Candidate("b", 100, 0, 5, 0, 0)])
        .name
        == "a"
    )  # off: the least loaded


def test_new_prefixes_go_to_the_emptier_cache_until_the_caches_are_about_as_full():
    """Rendezvous order alone would put every key below on "b"; the cache bound deals them out instead."""
    policy = PrefixAware(weight=1.0, affinity_balance=1.25)

    def pick(held_a, held_b, prompt=1000, a_requests=0):
        candidates = [Candidate("a", prompt, 0, 0, a_requests, 1, held_a), Candidate("b", prompt, 0, 0, 0, 0, held_b)]
        return policy.choose(candidates).name

    assert pick(0, 0) == "b"  # empty caches: the order
    assert pick(0, 1000) == "a"  # 2000 > 1.25 * 2000 / 2
    assert pick(1000, 1000) == "b"  # neither within the bound (2000 > 1500): the one holding least, a tie: the order
    assert pick(3000, 5000) == "a"  # 6000 > 1.25 * 9000 / 2 = 5625
    assert pick(4000, 5000) == "b"  # 6000 <= 1.25 * 10000 / 2: about as full, the order again
    assert pick(5000, 5000) == "b"  # full caches alike: the key keeps its backend
    assert pick(0, 5000, a_requests=3) == "b"  # the bound on requests still holds first: 4 > ceil(1.25 * 4 / 2)


def test_tenants_deal_out_over_two_backends_by_what_their_caches_hold(vllm, router):
    """8 tenants' first requests, one after the other, each stored before the next: 4 per backend, whatever
    the rendezvous order of their keys (with 2 backends, 8 keys fall 6:2 or worse 29% of the time)."""
    a, b = vllm("a", auto_store=True), vllm("b", auto_store=True)
    r = router([a, b], event_sources=[a.source(), b.source()])
    a.wait_subscribed(r)
    b.wait_subscribed(r)
    homes = []
    for tenant in range(8):
        prompt = [100 + tenant] * 64 + [1, 2]
        home = served_by(complete(r, prompt=prompt))
        backend = a if home == a.url else b
        wait_until(lambda x=backend: index_blocks(r, x) == len(x.blocks), what="the stored prompt in the index")
        homes.append(home)
    assert sorted(homes.count(x.url) for x in (a, b)) == [4, 4], homes


def test_two_replicas_send_a_split_burst_of_a_new_prefix_to_one_backend(vllm, router):
    """Each replica sees the others' requests only once their events come; the key's order is shared at once."""
    a, b = vllm("a"), vllm("b")
    replicas = [router([a, b], event_sources=[a.source(), b.source()]) for _ in range(2)]
    homes = set()
    for tenant in range(16):
        prompt = [100 + tenant] * 16 + [1, 2, 3, 4]
        a.proceed.clear()
        b.proceed.clear()
        before = len(a.received) + len(b.received)
        with ThreadPoolExecutor(4) as clients:
            futures = [clients.submit(complete, replicas[k % 2], prompt=prompt) for k in range(4)]
            wait_until(lambda n=before + 4: len(a.received) + len(b.received) == n, what="the burst at the backends")
            a.proceed.set()
            b.proceed.set()
            landed = {served_by(f.result()) for f in futures}
        assert len(landed) == 1, f"tenant {tenant}'s burst split over {landed}"
        homes |= landed
    assert homes == {a.url, b.url}
