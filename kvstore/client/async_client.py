"""``AsyncClient``: the same client for asyncio callers.

Each call runs the blocking ``Client`` on a small thread pool, so many calls can be in flight from
one event loop while bulk copies (numpy, sockets) release the GIL; one implementation of every
transport serves both.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.client.sync_client import Client
from kvstore.keys import Namespace
from kvstore.wire import Lookup


class AsyncClient:
    """asyncio façade over ``Client`` (same arguments, plus ``max_in_flight`` threads)."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 5.0,
                 transport: str = "auto", max_in_flight: int = 8, **kwargs) -> None:
        self._client = Client(url, token=token, timeout_s=timeout_s, transport=transport, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="kvstore-async")

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def register_namespace(self, ns: Namespace) -> bytes:
        return await self._run(self._client.register_namespace, ns)

    async def lookup(self, ns_id, hashes, lease: bool = True, producer: str = "", local_only: bool = False) -> Lookup:
        return await self._run(self._client.lookup, ns_id, hashes, lease, producer, local_only)

    async def lookup_many(self, ns_id, chains, lease: bool = True) -> list[Lookup]:
        return await self._run(self._client.lookup_many, ns_id, chains, lease)

    async def exists(self, ns_id, hashes) -> list[bool]:
        return await self._run(self._client.exists, ns_id, hashes)

    async def put(self, ns_id, hashes, blocks, parent=None, encode: str | None = None) -> list[str]:
        return await self._run(self._client.put, ns_id, hashes, blocks, parent, encode)

    async def get_into(self, ns_id, hashes, outs, byte_range: tuple[int, int] | None = None) -> list[int | None]:
        return await self._run(self._client.get_into, ns_id, hashes, outs, byte_range)

    async def get(self, ns_id, hashes) -> list[bytes | None]:
        return await self._run(self._client.get, ns_id, hashes)

    async def delete(self, ns_id, hashes) -> int:
        return await self._run(self._client.delete, ns_id, hashes)

    async def stats(self) -> dict:
        return await self._run(self._client.stats)

    async def route(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[dict]:
        return await self._run(self._client.route, ns_id, hashes)

    async def health(self) -> bool:
        return await self._run(self._client.health)

    @property
    def active_transport(self) -> str:
        return self._client.active_transport

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
