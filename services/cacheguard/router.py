"""Router: which engine replica serves a session's request.

1. A session whose replica is known (affinity.Affinity, in redis) goes back to it while it is
   healthy: its prefix pages are in that replica's device cache.
2. A new session goes to the least-loaded READY replica (Engine.GetStats running + waiting; ties
   rotate, so idle replicas share new sessions), and the choice is recorded.
3. A session whose replica is down (its channel fails to become READY, or a call to it failed with
   UNAVAILABLE: the caller passes it in `exclude`) moves to the least-loaded other replica, where
   its prefix is prefilled again (correct, only slower), and the record is updated.
Routing only picks where token ids go: pages are shared by their hash chain inside one engine,
so different token prefixes never share KV whatever the route.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from services.cacheguard.affinity import Affinity
from services.cacheguard.engine_client import EnginePool, EngineUnavailableError, Replica

logger = logging.getLogger(__name__)

AFFINITY = "affinity"
LEAST_LOADED = "least_loaded"
MOVED = "moved"
DECISIONS = (AFFINITY, LEAST_LOADED, MOVED)


class Route(NamedTuple):
    """Where a request goes and why (moved_from: the session's previous replica when moved)."""

    replica: Replica
    decision: str
    moved_from: str


class Router:
    """Session affinity over an EnginePool; one per guard, inside its event loop."""

    def __init__(self, pool: EnginePool, affinity: Affinity) -> None:
        self.pool = pool
        self.affinity = affinity
        self._turn = 0  # rotates ties between equally loaded replicas

    async def route(self, tenant: str, session_id: str, exclude: frozenset[str] = frozenset()) -> Route:
        """The replica for this session's next request; raises EngineUnavailableError when none is up."""
        known = await self.affinity.get(tenant, session_id)
        if known is not None and known not in exclude:
            replica = self.pool.by_addr(known)
            if replica is not None and await self.pool.ready(replica):
                return Route(replica, AFFINITY, "")
            logger.info("session %s: its replica %s is down or gone; moving it", session_id, known)
        avoid = exclude | {known} if known is not None else exclude
        chosen = await self.least_loaded(avoid)
        if known is None:
            recorded = await self.affinity.claim(tenant, session_id, chosen.addr)
        else:
            recorded = await self.affinity.move(tenant, session_id, known, chosen.addr)
        if recorded != chosen.addr:
            # Another guard placed or moved this session first: follow it while that replica is usable.
            other = self.pool.by_addr(recorded)
            if other is not None and recorded not in avoid and await self.pool.ready(other):
                return Route(other, AFFINITY if known is None else MOVED, known or "")
            await self.affinity.move(tenant, session_id, recorded, chosen.addr)
        return Route(chosen, LEAST_LOADED if known is None else MOVED, known or "")

    async def least_loaded(self, exclude: frozenset[str] = frozenset()) -> Replica:
        """The READY replica (not in exclude) with the fewest running + waiting sequences."""
        ready = await self.pool.ready_replicas(exclude)
        loads = await asyncio.gather(*(self.pool.load(r) for r in ready))
        live = [(load, r) for load, r in zip(loads, ready, strict=True) if load is not None]
        if not live:
            raise EngineUnavailableError(f"no engine replica answers GetStats: {', '.join(r.addr for r in ready)}")
        lowest = min(load for load, _ in live)
        ties = [r for load, r in live if load == lowest]
        chosen = ties[self._turn % len(ties)]
        self._turn += 1
        return chosen
