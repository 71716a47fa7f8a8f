"""One place that turns a Redis URL into a client: the fleet directory and the Redis tier share it.

A leaf: imports nothing from kvstore, so the Redis tier (below the store) and the fleet (above it)
both depend down on it instead of on each other.
"""

from __future__ import annotations


def connect(redis_url: str, socket_timeout_s: float = 0.5):
    """A redis-py client for ``redis://``/``rediss://``/``unix://`` or a cluster client for
    ``redis+cluster://host:port``. Short timeouts: the directory is advice, never worth a stall."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    kw = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
              retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 1), health_check_interval=5)
    if redis_url.startswith("redis+cluster://"):
        from redis.cluster import RedisCluster
        return RedisCluster.from_url("redis://" + redis_url[len("redis+cluster://"):], **kw)
    return redis.Redis.from_url(redis_url, **kw)
