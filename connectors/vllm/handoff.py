"""Prefill-to-decode hand-off: the producer names the blocks it saves, the consumer waits for them.

A producer's saves reach the daemon in the background, after the prefill request has already
answered; a consumer that looked the prompt up at once would miss and recompute it (the race P/D
exists to avoid). So the producer's finished request returns, in ``kv_transfer_params``, exactly
the blocks the consumer can expect:

    {"do_remote_prefill": true, "do_remote_decode": false,
     "kvstore": {"namespace": "<id hex>", "blocks": 15, "unsaved": 0, "block_tokens": 32,
                 "last_hash": "<chain hash of block 15, hex>", "daemon": "<producer's daemon url>",
                 "node": "<producer's daemon's fleet node id, or null>"}}

``blocks`` are the leading prompt blocks the producer stands behind: saved, queued for saving, or
already held by its daemon (another request stored them; they are not saved again). ``unsaved``
are the prompt's full blocks after those that it knows will not reach its daemon (its daemon did
not answer it): the consumer recomputes them at once instead of waiting for them, and counts it.
``last_hash`` is the chain hash of block ``blocks + unsaved``, the last one the params speak of.

The consumer, handed those params (a proxy copies them into the decode request, as for vLLM's
other P/D connectors), defers the request (``get_num_new_matched_tokens`` answers None) until its
daemon holds all ``blocks`` leading blocks, then loads them. A chain hash commits to every token
before it, so ``last_hash`` equal to the consumer's own hash of that block proves both name
the same prompt under the same model and settings; params that do not match are refused (counted)
and the request is served as any other. The wait is bounded (``pd_wait_s``): past it, or at once
when the consumer's daemon does not answer, the consumer loads the leading blocks that did arrive
and recomputes the rest, counted and logged. Only whole blocks the daemon holds are ever loaded.

``HandoffWaiter`` polls on a thread of its own (a lookup every ``pd_poll_s``), so the scheduler's
loop never blocks on the daemon: while a request waits, each scheduler pass costs a dictionary read.

Named blocks are pinned against eviction from the hand-off until the consumer loads them, under
the daemon's lookup leases (``lease_seconds``, 5 s by default): the producer looks the blocks its
daemon already held on arrival up again with a lease as it names them (blocks it finds evicted by
then it marks unsaved), and each of the waiter's polls is a leased lookup, which pins the leading
blocks that are there for ``lease_seconds`` again; the consumer's own lookup, which plans the
load, pins them once more. What is left open: a decode request that reaches its consumer more
than ``lease_seconds`` after the hand-off; a block this request saves, in the ``pd_poll_s`` between
its landing and the next poll; and, where the client answers a lookup from the daemon's mapped
index, the few milliseconds before its lease note reaches the daemon (or a note dropped because
the daemon is behind). A block lost in one of these is recomputed after ``pd_wait_s``.

With a fleet the consumer's daemon fetches the blocks from the producer's daemon during these
lookups. The waiter's lookups name the producer's fleet node (``node``, which the producer's
daemon told it at the handshake), and the consumer's daemon fetches what it misses from that
member directly, without waiting for the blocks to be published in the directory
(``kvstore.fleet.direct``); without a ``node``, or when that fails, by verified peer fetch through
the directory (docs/fleet.md). The consumer never calls the producer's daemon itself, and its own
daemon takes a node id from no one but the fleet's signed membership; the producer's lease pins the
blocks on its own daemon, the waiter's on the consumer's.

Params come from the client's request body, so they are untrusted: they can at most make their own
request wait ``pd_wait_s`` for blocks of its own prompt, or count its own recompute, and make the
consumer's daemon fetch blocks of that prompt from a member of its fleet.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstore.client import NamespaceHandle

logger = logging.getLogger("kvstore.connectors.vllm")

PARAMS_KEY = "kvstore"
#: a prompt of 2**20 blocks is far beyond any context length: a larger count is not a real prompt
MAX_HANDOFF_BLOCKS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Handoff:
    """The blocks a producer saves for one request."""

    namespace_id: bytes
    blocks: int            # leading full blocks (kvstore blocks: chunks of ``block_tokens``) to wait for
    block_tokens: int
    last_hash: bytes       # chain hash of block ``blocks + unsaved``
    daemon: str | None = None
    unsaved: int = 0       # full blocks after those that the producer knows it did not save
    node: str | None = None   # the producer's daemon's fleet node id (None: not in a fleet, or unknown)

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` for the finished prefill request (vLLM's P/D convention)."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                PARAMS_KEY: {"namespace": self.namespace_id.hex(), "blocks": self.blocks,
                             "unsaved": self.unsaved, "block_tokens": self.block_tokens, "last_hash": self.last_hash.hex(),
                             "daemon": self.daemon, "node": self.node}}

    @classmethod
    def from_params(cls, params: Any) -> "Handoff | None":
        """The hand-off named in a request's ``kv_transfer_params``; None when it names none.
        Raises ValueError naming the field when the params are malformed."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or PARAMS_KEY not in params:
            return None
        p = params[PARAMS_KEY]
        if not isinstance(p, dict):
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY}: not an object")

        def field(name: str, kind: type):
            value = p.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.{name}: missing or not a {kind.__name__}")
            return value

        blocks, block_tokens = field("blocks", int), field("block_tokens", int)
        unsaved = field("unsaved", int) if "unsaved" in p else 0
        if not 0 <= blocks <= MAX_HANDOFF_BLOCKS or block_tokens <= 0:
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.blocks/block_tokens: out of range")
        if not 0 <= unsaved <= MAX_HANDOFF_BLOCKS:
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.unsaved: out of range")
        try:
            namespace_id, last_hash = bytes.fromhex(field("namespace", str)), bytes.fromhex(field("last_hash", str))
        except ValueError:
            raise ValueError(f"kv_transfer_params.{PARAMS_KEY}.namespace/last_hash: not hex") from None
        daemon, node = p.get("daemon"), p.get("node")
        return cls(namespace_id, blocks, block_tokens, last_hash, daemon if isinstance(daemon, str) else None, unsaved,
                   node if isinstance(node, str) and node else None)

    def mismatch(self, namespace_id: bytes, block_tokens: int, hashes: Sequence[bytes]) -> str | None:
        """Why these params do not name blocks of this prompt in this namespace (None: they do)."""
        if self.namespace_id != namespace_id:
            return "another namespace (model, layout or settings differ from the producer's)"
        if self.block_tokens != block_tokens:
            return f"blocks of {self.block_tokens} tokens, not {block_tokens}"
        named = self.blocks + self.unsaved
        if named > len(hashes):
            return f"{named} blocks, the prompt has {len(hashes)} full ones"
        if named and hashes[named - 1] != self.last_hash:
            return "another prompt (the chain hashes differ)"
        return None


@dataclasses.dataclass
class Expected:
    """What a consumer's request was told to expect of its hand-off, kept until its lookup settles
    it: blocks ``named`` (to wait for) and ``unsaved`` (to recompute), and, once its wait has ended,
    how (``outcome``, as ``Wait``'s) and the wait's ``describe()`` for the log line."""

    named: int
    unsaved: int
    outcome: str = ""
    polls: str = ""


@dataclasses.dataclass
class Wait:
    """One request waiting for a hand-off's blocks."""

    hashes: list[bytes]
    deadline: float
    started: float
    producer: str = ""             # the fleet node named to the daemon as the blocks' producer
    outcome: str | None = None     # "arrived", "timeout" or "unavailable" (the daemon did not answer)
    seconds: float = 0.0
    polls: int = 0                 # lookups answered so far ...
    found: int = 0                 # ... the leading blocks the last one found
    last_poll: float = 0.0         # ... and when it was asked (monotonic)

    def describe(self) -> str:
        """How the waiting went, for the log line of a wait that ended without all its blocks."""
        last = f", the last {self.last_poll - self.started:.2f}s in, finding {self.found}" if self.polls else ""
        return f"{self.polls} polls{last}"


class HandoffWaiter:
    """Polls the daemon for the blocks of waiting requests on one background thread.

    ``handles``: the namespaces every rank's blocks live in (all must hold a block for it to count),
    owned by the waiter (closed by ``close``)."""

    def __init__(self, handles: list[NamespaceHandle], poll_s: float) -> None:
        self.handles = handles
        self.poll_s = poll_s
        self._waits: dict[str, Wait] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-handoff", daemon=True)
        self._thread.start()

    def watch(self, req_id: str, hashes: list[bytes], wait_s: float, producer: str = "") -> Wait:
        """Poll for ``hashes`` until they are all there or ``wait_s`` has passed; ``producer``: the
        fleet node its lookups name as their producer (a P/D hand-off's ``node``)."""
        now = time.monotonic()
        wait = Wait(hashes, now + wait_s, now, producer)
        with self._cond:
            self._waits[req_id] = wait
            self._cond.notify_all()
        return wait

    def cancel(self, req_id: str) -> None:
        with self._cond:
            self._waits.pop(req_id, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waits:
                    self._cond.wait()
                if self._closed:
                    return
                waiting = [(r, w) for r, w in self._waits.items() if w.outcome is None]
            for req_id, wait in waiting:
                outcome = self._check(wait)
                if outcome is not None:
                    with self._cond:
                        wait.seconds = time.monotonic() - wait.started
                        wait.outcome = outcome      # read by the scheduler thread after this
                        self._waits.pop(req_id, None)
            with self._cond:
                if not self._closed:
                    self._cond.wait(self.poll_s)

    def _check(self, wait: Wait) -> str | None:
        """One poll. It times out only when a lookup asked at or past the deadline still misses
        blocks: an answer taken earlier and read late (this thread may wait long for the GIL)
        proves nothing about the blocks at the deadline."""
        asked = time.monotonic()
        found = len(wait.hashes)
        for handle in self.handles:
            # leased: what is there stays there until the consumer's own lookup pins it for the load
            got = handle.call(lambda c, ns: c.lookup(ns, wait.hashes[:found], True, producer=wait.producer).num_hit,
                              "lookup")
            if got is None:
                return "unavailable"
            found = min(found, got)
        wait.polls, wait.found, wait.last_poll = wait.polls + 1, found, asked
        if found >= len(wait.hashes):
            return "arrived"
        return "timeout" if asked >= wait.deadline else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        for handle in self.handles:
            handle.close()
