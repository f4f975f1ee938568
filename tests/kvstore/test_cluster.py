"""KVStoreCluster over several real kvstore processes sharing one real redis catalog: placement by
consistent hashing, lookup through the catalog after membership changes, batched gets on both
paths, pins across replicas, and a killed replica whose pages (only) go missing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from services.common import auth
from services.kvstore.client import KVStoreClient, KVStoreRefused, PageMeta, PageNotFoundError
from services.kvstore.cluster import KVStoreCluster
from services.kvstore.placement import HashRing
from tests.conftest import StartStore, Store
from tests.kvstore.test_server import page, wait_for


@pytest.fixture
def prefix() -> str:
    return f"kvmem-test-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def cluster(redis_url: str, prefix: str) -> Iterator[KVStoreCluster]:
    # refresh often; replicas beat every 0.5 s in tests, so 1.5 s without one is a lost replica
    with KVStoreCluster(redis_url, prefix, refresh_s=0.05, stale_after_s=1.5) as c:
        yield c


def start_replicas(start_store: StartStore, prefix: str, n: int, first: int = 0) -> list[Store]:
    return [start_store(host_kv_mib=16, replica_id=f"r{first + i}", prefix=prefix) for i in range(n)]


def pages(n: int, first: int = 0) -> list[tuple[PageMeta, bytes]]:
    return [page(first + i, 8192 + i) for i in range(n)]


def payloads(batch: list) -> list[bytes | None]:
    return [None if x is None else bytes(x) for x in batch]


def test_placement_across_three_replicas(start_store: StartStore, cluster: KVStoreCluster, prefix: str) -> None:
    stores = start_replicas(start_store, prefix, 3)
    assert cluster.replicas() == {s.replica_id: s.address for s in stores}
    ring = HashRing(["r0", "r1", "r2"])
    batch = pages(60)
    locations = cluster.put_pages(batch)
    assert [loc.replica_id for loc in locations] == [ring.owner(m.page_hash) for m, _ in batch]
    per_replica = {rid: cluster.info()[rid].num_pages for rid in ("r0", "r1", "r2")}
    assert sum(per_replica.values()) == 60 and min(per_replica.values()) > 5, per_replica
    for s in stores:  # each page is on its owner and nowhere else
        with KVStoreClient(s.address) as direct:
            found = [loc.found for loc in direct.lookup([m.page_hash for m, _ in batch])]
            assert found == [ring.owner(m.page_hash) == s.replica_id for m, _ in batch]
    assert [loc.replica_id for loc in cluster.lookup([m.page_hash for m, _ in batch])] == [
        loc.replica_id for loc in locations
    ]
    assert cluster.get_page(batch[7][0].page_hash) == batch[7][1]
    assert set(cluster.arena_mappings()) == {"r0", "r1", "r2"}  # all on this host: all mapped


@pytest.mark.parametrize("shared_memory", [True, False])
def test_batched_get_over_the_cluster(
    start_store: StartStore, redis_url: str, prefix: str, shared_memory: bool
) -> None:
    start_replicas(start_store, prefix, 3)
    batch = pages(30)
    with KVStoreCluster(redis_url, prefix, shared_memory=shared_memory, refresh_s=0.05) as cluster:
        cluster.put_pages(batch)
        hashes = [m.page_hash for m, _ in batch][::-1]
        with cluster.get_pages(hashes, owner_id="engine-1") as got:
            assert payloads(got) == [d for _, d in batch][::-1]
            assert {type(x) for x in got} == ({memoryview} if shared_memory else {bytes})
            pinned = sum(i.num_pinned_pages for i in cluster.info().values())
            assert pinned == (30 if shared_memory else 0)
        assert sum(i.num_pinned_pages for i in cluster.info().values()) == 0
        absent = (12345).to_bytes(16, "big")
        with pytest.raises(PageNotFoundError) as e:
            cluster.get_pages([hashes[0], absent])
        assert e.value.page_hashes == (absent,)


def test_lookup_through_the_catalog_after_membership_changes(
    start_store: StartStore, cluster: KVStoreCluster, prefix: str
) -> None:
    start_replicas(start_store, prefix, 2)
    batch = pages(40)
    cluster.put_pages(batch)
    wait_for(lambda: cluster.longest_prefix([m.page_hash for m, _ in batch]) == 40)  # catalog caught up
    start_replicas(start_store, prefix, 1, first=2)  # r2 joins: it now owns pages it never got
    cluster.refresh(force=True)
    moved = [m.page_hash for m, _ in batch if cluster.replica_for(m.page_hash) == "r2"]
    assert 5 < len(moved) < 30
    locations = cluster.lookup(moved)
    assert all(loc.found and loc.replica_id in ("r0", "r1") for loc in locations)
    with cluster.get_pages([m.page_hash for m, _ in batch]) as got:
        assert payloads(got) == [d for _, d in batch]
    assert cluster.get_page(moved[0]) == dict((m.page_hash, d) for m, d in batch)[moved[0]]
    assert all(loc.found for loc in cluster.pin("engine-9", moved))
    assert cluster.unpin("engine-9") == len(moved)


def test_a_killed_replica_loses_only_its_pages(start_store: StartStore, cluster: KVStoreCluster, prefix: str) -> None:
    stores = start_replicas(start_store, prefix, 3)
    batch = pages(60)
    locations = cluster.put_pages(batch)
    victim = stores[1]
    victim.proc.kill()  # no unregister: its catalog entries and last heartbeat stay in redis
    victim.proc.wait(timeout=10)
    lost = [loc.replica_id == victim.replica_id for loc in locations]
    with cluster.get_pages([m.page_hash for m, _ in batch], missing_ok=True) as got:
        assert payloads(got) == [None if gone else d for (_, d), gone in zip(batch, lost, strict=True)]
    assert victim.replica_id not in cluster.replicas()  # dropped on UNAVAILABLE, before its heartbeat went stale
    gone = batch[lost.index(True)][0].page_hash
    with pytest.raises(PageNotFoundError):
        cluster.get_page(gone)
    assert not cluster.lookup([gone])[0].found
    assert cluster.longest_prefix([gone]) == 0
    fresh = pages(30, first=1000)  # new pages land on the two that are left
    assert {loc.replica_id for loc in cluster.put_pages(fresh)} == {"r0", "r2"}
    with cluster.get_pages([m.page_hash for m, _ in fresh]) as got:
        assert payloads(got) == [d for _, d in fresh]


def test_puts_to_a_dead_owner_go_to_the_next_replica(
    start_store: StartStore, cluster: KVStoreCluster, prefix: str
) -> None:
    stores = start_replicas(start_store, prefix, 2)
    assert len(cluster.replicas()) == 2  # the cluster knows both, heartbeats fresh
    stores[0].proc.kill()
    stores[0].proc.wait(timeout=10)
    batch = pages(20)
    assert {loc.replica_id for loc in cluster.put_pages(batch)} == {"r1"}
    assert payloads(cluster.get_pages([m.page_hash for m, _ in batch])) == [d for _, d in batch]


def test_a_replica_that_refuses_this_client_is_dropped_like_a_dead_one(
    start_store: StartStore, cluster: KVStoreCluster, prefix: str
) -> None:
    """A replica of another deployment registered in the same catalog (another internal secret: every call is
    UNAUTHENTICATED) is unusable from here: KVStoreRefused, an unavailable replica to the cluster, so puts go to
    the next replica and lookups find them; it used to raise out of the lookup of an engine's prefix match and end
    the engine's loop."""
    start_store(host_kv_mib=16, replica_id="r0", prefix=prefix)
    start_store(host_kv_mib=16, replica_id="r1", prefix=prefix, env={auth.SECRET_ENV: "another-deployment"})
    assert set(cluster.replicas()) == {"r0", "r1"}
    with pytest.raises(KVStoreRefused, match="UNAUTHENTICATED"):
        with KVStoreClient(cluster.replicas()["r1"]) as direct:
            direct.lookup([pages(1)[0][0].page_hash])
    batch = pages(20)
    ring = HashRing(["r0", "r1"])
    assert {ring.owner(m.page_hash) for m, _ in batch} == {"r0", "r1"}  # some are r1's by placement
    assert not any(loc.found for loc in cluster.lookup([m.page_hash for m, _ in batch]))  # asks r1 too: no raise
    assert {loc.replica_id for loc in cluster.put_pages(batch)} == {"r0"}
    assert all(loc.found for loc in cluster.lookup([m.page_hash for m, _ in batch]))
    assert payloads(cluster.get_pages([m.page_hash for m, _ in batch])) == [d for _, d in batch]
