"""kvstore as LMCache's L2 storage: an L2 adapter plugin for LMCache's multiprocess server.

Loaded by LMCache's "plugin" adapter type, by module path and class name::

    --l2-adapter '{"type": "plugin", "module_path": "kvstore.connectors.lmcache",
                   "class_name": "KVStoreL2Adapter",
                   "adapter_params": {"url": "127.0.0.1:7300"}}'

(``KVStoreL2AdapterConfig`` is found by LMCache's naming convention and built from
``adapter_params``.)

Mapping LMCache objects to kvstore blocks
-----------------------------------------
An LMCache ``ObjectKey`` is (chunk hash, model, kv_rank, object group, cache salt) and its
``MemoryObj`` is a fixed-size chunk in LMCache's own memory format. kvstore blocks live in a
namespace with one exact block size, so the namespace is (model, object shape, cache salt) and
the block hash is the chunk hash extended with kv_rank and object group: two shards or groups of
one chunk never share a block, and bytes of one shape are never read into a buffer of another.

The namespace's layout describes the object's bytes (``object_layout``) so kvstore's codecs can
compress them: an LMCache MP object of one kernel group is ``[2, layers, tokens, hidden]`` (K and
V; ``hidden`` = heads x head_dim, which LMCache does not split) or ``[layers, tokens, hidden]`` /
``[1, layers, tokens, hidden]`` (one plane: MLA latents), in a float dtype. Anything else (several
kernel groups in one object, integer or FP8 dtypes, no shape known) keeps the opaque layout
``lmcache_mp_object`` (dtype uint8), which codecs leave raw.

A lookup is told the object layout by LMCache's prefetch controller (``group_layout_descs``);
when it is not (``lmcache bench l2`` passes a placeholder), the object shapes this adapter has already
stored or loaded are tried.

Threads and failures
--------------------
LMCache's store and prefetch controller threads submit tasks and poll event fds; the adapter
never blocks them: each task runs on a small worker pool, then records its result and
signals the task kind's event fd. A daemon that is down or slow turns into failed stores and
zero bitmaps, never an exception: each namespace is reached through a
``kvstore.client.NamespaceHandle`` (all sharing one client and one circuit breaker), which
registers it again after a daemon restart and skips calls for a while after repeated failures.

Locks: a lookup also takes kvstore's lookup lease on the blocks it found, so they are not
evicted before the load that follows; leases expire by themselves, so unlock has nothing
to undo and always succeeds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvstore.client import CircuitBreaker, Client, NamespaceHandle
from kvstore.keys import MAX_HASH_BYTES, KVLayout, Namespace
from kvstore.wire import MAX_BATCH

logger = logging.getLogger(__name__)

LAYOUT_NAME = "lmcache_mp_object"


class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """adapter_params: url, token, timeout_s (per request), transport, num_workers, tenant."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout_s: float = 5.0,
                 transport: str = "auto", num_workers: int = 4, tenant: str = "") -> None:
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.transport = transport
        self.num_workers = num_workers
        self.tenant = tenant

    @classmethod
    def from_dict(cls, d: dict) -> "KVStoreL2AdapterConfig":
        known = {"url", "token", "timeout_s", "transport", "num_workers", "tenant"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"adapter_params: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        url = d.get("url")
        if url is not None and (not isinstance(url, str) or not url):
            raise ValueError("adapter_params.url must be a non-empty string like '127.0.0.1:7300'")
        timeout_s = d.get("timeout_s", 5.0)
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError("adapter_params.timeout_s must be a positive number")
        num_workers = d.get("num_workers", 4)
        if not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError("adapter_params.num_workers must be a positive integer")
        transport = d.get("transport", "auto")
        if transport not in ("auto", "grpc", "shm"):
            raise ValueError("adapter_params.transport must be one of 'auto', 'grpc', 'shm'")
        return cls(url=url, token=d.get("token"), timeout_s=float(timeout_s), transport=transport,
                   num_workers=num_workers, tenant=str(d.get("tenant", "")))

    @classmethod
    def help(cls) -> str:
        return ("kvstore L2 adapter fields (adapter_params):\n"
                "- url (str): kvstore daemon address, e.g. '127.0.0.1:7300' (default: the client's)\n"
                "- token (str): bearer token if the daemon requires one\n"
                "- timeout_s (float): per-request timeout (default 5)\n"
                "- transport (str): 'auto' | 'grpc' | 'shm' (default auto)\n"
                "- num_workers (int): worker threads for I/O (default 4)\n"
                "- tenant (str): extra namespace isolation (default empty)")


def block_hash(key: Any) -> bytes:
    """Chunk hash + kv_rank + object group: one block per shard and group of a chunk."""
    suffix = int(key.kv_rank).to_bytes(8, "big", signed=True) + int(key.object_group_id).to_bytes(4, "big")
    chunk = bytes(key.chunk_hash)
    if len(chunk) + len(suffix) > MAX_HASH_BYTES:
        chunk = hashlib.sha256(chunk).digest()
    return chunk + suffix


def object_bytes(obj: Any) -> torch.Tensor:
    """The object's payload as a flat uint8 tensor view (no copy)."""
    raw = obj.raw_tensor
    if raw is None:
        raise ValueError("memory object has no tensor")
    return raw.reshape(-1).view(torch.uint8)[: obj.get_size()]


#: what decides an object's namespace besides model and salt: (bytes, ((shape, dtype name), ...))
ObjectShape = tuple[int, tuple[tuple[tuple[int, ...], str], ...]]

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def object_shape(size: int, shapes: Any = None, dtypes: Any = None) -> ObjectShape:
    """An object's size and, when known, its kernel groups' shapes and dtypes."""
    groups = tuple((tuple(int(d) for d in shape), str(dtype).removeprefix("torch."))
                   for shape, dtype in zip(shapes or (), dtypes or ()))
    return int(size), groups


def object_layout(model: str, shape: ObjectShape) -> KVLayout:
    """The namespace layout of LMCache objects of ``shape`` (see the module docstring)."""
    size, groups = shape
    if len(groups) == 1:
        dims, dtype = groups[0]
        if len(dims) == 4 and dims[0] == 1:
            dims = dims[1:]
        kv = 2 if len(dims) == 4 and dims[0] == 2 else 1
        if dtype in _FLOAT_DTYPES and len(dims) == 3 + (kv == 2) and min(dims) > 0:
            layers, tokens, hidden = dims[-3:]
            layout = KVLayout(model=model, num_layers=layers, num_kv_heads=1, head_dim=hidden, dtype=dtype,
                              block_tokens=tokens, layout="kv,layer,token,dim" if kv == 2 else "layer,token,dim",
                              kv_per_token=kv)
            if layout.block_bytes == size:
                return layout
    return KVLayout(model=model, num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                    block_tokens=1, layout=LAYOUT_NAME, kv_per_token=1, block_bytes=size)


def obj_shape(obj: Any) -> ObjectShape:
    """The ``ObjectShape`` of a MemoryObj: its kernel groups' shapes and dtypes when its metadata
    records them, else its one logical shape and dtype (what the allocating layout described)."""
    for shapes_of, dtypes_of in (("get_shapes", "get_dtypes"), ("get_shape", "get_dtype")):
        try:
            shapes, dtypes = getattr(obj, shapes_of)(), getattr(obj, dtypes_of)()
        except (AssertionError, AttributeError, NotImplementedError, TypeError):  # (not recorded)
            continue
        if shapes_of == "get_shape":
            shapes, dtypes = [shapes], [dtypes]
        if shapes and dtypes and all(d is not None for d in dtypes):
            return object_shape(obj.get_size(), shapes, dtypes)
    return object_shape(obj.get_size())


def layout_desc_bytes(desc: Any) -> int:
    """Bytes of one object described by an LMCache MemoryLayoutDesc (0 if it is a placeholder)."""
    total = 0
    for shape, dtype in zip(getattr(desc, "shapes", []) or [], getattr(desc, "dtypes", []) or []):
        n = 1
        for d in shape:
            n *= int(d)
        total += n * torch.empty((), dtype=dtype).element_size()
    return total


class _Finished:
    """The results of finished tasks of one kind (store, lookup or load), and the event fd
    LMCache waits on for them."""

    def __init__(self) -> None:
        self.efd = create_event_notifier()
        self._lock = threading.Lock()
        self._results: dict[L2TaskId, Any] = {}

    def put(self, tid: L2TaskId, result: Any) -> None:
        with self._lock:
            self._results[tid] = result
        self.efd.notify()

    def pop(self, tid: L2TaskId) -> Any:
        with self._lock:
            return self._results.pop(tid, None)

    def pop_all(self) -> dict[L2TaskId, Any]:
        with self._lock:
            done, self._results = self._results, {}
        return done


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter backed by a kvstore daemon (see the module docstring)."""

    def __init__(self, config: KVStoreL2AdapterConfig | dict | None = None, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)  # the daemon evicts by itself
        if config is None:
            config = KVStoreL2AdapterConfig()
        elif isinstance(config, dict):
            config = KVStoreL2AdapterConfig.from_dict(config)
        self.config = config
        self.client = Client(url=config.url, token=config.token, timeout_s=config.timeout_s,
                             transport=config.transport)
        self._stored, self._looked_up, self._loaded = _Finished(), _Finished(), _Finished()
        self._pool = ThreadPoolExecutor(max_workers=config.num_workers, thread_name_prefix="kvstore-l2")
        self._lock = threading.Lock()
        self._next_task_id: L2TaskId = 0
        self._breaker = CircuitBreaker()   # one daemon behind every namespace: one breaker
        self._namespaces: dict[tuple[str, str, ObjectShape], NamespaceHandle] = {}  # (model, salt, shape) -> handle
        self._shapes: dict[tuple[str, str], set[ObjectShape]] = {}                # (model, salt) -> shapes seen
        self._closed = False

    # ---- event fds ---------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._stored.efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._looked_up.efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._loaded.efd.fileno()

    # ---- namespaces ----------------------------------------------------------------------
    def _namespace(self, model: str, salt: str, shape: ObjectShape) -> NamespaceHandle:
        """The handle of the namespace for objects of this model, salt and shape."""
        k = (model, salt, shape)
        with self._lock:
            handle = self._namespaces.get(k)
            if handle is None:
                handle = self._namespaces[k] = NamespaceHandle(
                    Namespace(object_layout(model, shape), tenant=self.config.tenant, cache_salt=salt),
                    client=self.client, breaker=self._breaker, name="kvstore L2")
                self._shapes.setdefault((model, salt), set()).add(shape)
            return handle

    # ---- tasks ---------------------------------------------------------------------------
    def _new_task(self) -> L2TaskId:
        with self._lock:
            tid = self._next_task_id
            self._next_task_id += 1
            return tid

    @staticmethod
    def _groups(keys: list, shapes: list[ObjectShape]) -> dict[tuple[str, str, ObjectShape], list[int]]:
        """Key indices grouped by namespace (model, salt, object shape), in order."""
        groups: dict[tuple[str, str, ObjectShape], list[int]] = {}
        for i, (k, shape) in enumerate(zip(keys, shapes)):
            groups.setdefault((k.model_name, k.cache_salt, shape), []).append(i)
        return groups

    def submit_store_task(self, keys: list, objects: list) -> L2TaskId:
        tid = self._new_task()
        self._pool.submit(self._run_store, tid, list(keys), list(objects))
        return tid

    def _run_store(self, tid: L2TaskId, keys: list, objects: list) -> None:
        ok, stored = True, 0
        try:
            shapes = [obj_shape(o) for o in objects]
            sizes = [shape[0] for shape in shapes]
            for (model, salt, shape), idx in self._groups(keys, shapes).items():
                handle = self._namespace(model, salt, shape)
                for s in range(0, len(idx), MAX_BATCH):
                    part = idx[s:s + MAX_BATCH]
                    ok = handle.put([block_hash(keys[i]) for i in part], [object_bytes(objects[i]) for i in part])
                    if not ok:
                        break
                    stored += shape[0] * len(part)
                if not ok:
                    break
            if ok and keys:
                self._notify_keys_stored(keys, sizes)
        except Exception as e:  # a malformed object, not the daemon (the handle turns those into False)
            ok = False
            logger.warning("kvstore L2 store failed: %s", e)
        self._stored.put(tid, L2StoreResult(ok, stored if ok else 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._stored.pop_all()

    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> L2TaskId:
        tid = self._new_task()
        self._pool.submit(self._run_lookup, tid, list(keys), dict(group_layout_descs or {}))
        return tid

    def _candidate_shapes(self, key: Any, descs: dict) -> list[ObjectShape]:
        """The object's shape from the lookup's layout description, else every shape seen."""
        desc = descs.get(key.object_group_id)
        size = layout_desc_bytes(desc) if desc is not None else 0
        if size > 0:
            return [object_shape(size, getattr(desc, "shapes", None), getattr(desc, "dtypes", None))]
        with self._lock:
            return sorted(self._shapes.get((key.model_name, key.cache_salt), ()))

    def _run_lookup(self, tid: L2TaskId, keys: list, descs: dict) -> None:
        bitmap = Bitmap(len(keys))
        try:
            pending = list(range(len(keys)))
            shapes_per_key = [self._candidate_shapes(k, descs) for k in keys]
            max_tries = max((len(s) for s in shapes_per_key), default=0)
            for attempt in range(max_tries):
                tries = [i for i in pending if attempt < len(shapes_per_key[i])]
                groups = self._groups([keys[i] for i in tries], [shapes_per_key[i][attempt] for i in tries])
                found: set[int] = set()
                for (model, salt, shape), local in groups.items():
                    idx = [tries[j] for j in local]
                    hashes = [block_hash(keys[i]) for i in idx]
                    handle = self._namespace(model, salt, shape)
                    present = handle.exists(hashes)
                    hit = [i for i, p in zip(idx, present) if p]
                    if hit:  # the lock: one lookup over the hits leases them until the load
                        handle.lookup([block_hash(keys[i]) for i in hit])
                    found.update(hit)
                for i in found:
                    bitmap.set(i)
                pending = [i for i in pending if i not in found]
        except Exception as e:  # a malformed key or layout, not the daemon
            logger.warning("kvstore L2 lookup failed: %s", e)
        self._looked_up.put(tid, bitmap)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._looked_up.pop(task_id)

    def submit_unlock(self, keys: list) -> None:
        """Nothing to do: kvstore's lookup leases expire on their own."""

    def submit_load_task(self, keys: list, objects: list) -> L2TaskId:
        tid = self._new_task()
        self._pool.submit(self._run_load, tid, list(keys), list(objects))
        return tid

    def _run_load(self, tid: L2TaskId, keys: list, objects: list) -> None:
        bitmap = Bitmap(len(keys))
        try:
            shapes = [obj_shape(o) for o in objects]
            hits = []
            for (model, salt, shape), idx in self._groups(keys, shapes).items():
                handle, size = self._namespace(model, salt, shape), shape[0]
                for s in range(0, len(idx), MAX_BATCH):
                    part = idx[s:s + MAX_BATCH]
                    outs = [object_bytes(objects[i]).numpy() for i in part]
                    got = handle.get_into([block_hash(keys[i]) for i in part], outs)
                    for i, n in zip(part, got):
                        if n is not None and n == size:
                            bitmap.set(i)
                            hits.append(keys[i])
            if hits:
                self._notify_keys_accessed(hits)
        except Exception as e:  # a malformed object, not the daemon
            logger.warning("kvstore L2 load failed: %s", e)
        self._loaded.put(tid, bitmap)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._loaded.pop(task_id)

    # ---- optional -----------------------------------------------------------------------
    def delete(self, keys: list) -> None:
        by_ns: dict[tuple[str, str], list] = {}
        for k in keys:
            by_ns.setdefault((k.model_name, k.cache_salt), []).append(k)
        for (model, salt), ks in by_ns.items():
            with self._lock:
                shapes = sorted(self._shapes.get((model, salt), ()))
            for shape in shapes:
                self._namespace(model, salt, shape).delete([block_hash(k) for k in ks])

    def report_status(self) -> dict:
        try:
            healthy = bool(self.client.health())
        except Exception:
            healthy = False
        return {"is_healthy": healthy, "type": "KVStoreL2Adapter", "url": self.config.url,
                "namespaces": len(self._namespaces)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            self.client.close()
        except Exception:
            pass
        for finished in (self._stored, self._looked_up, self._loaded):
            finished.efd.close()
