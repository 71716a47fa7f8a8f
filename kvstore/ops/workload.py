"""Workloads for the sizing planner: a JSONL trace reader and synthetic generators.

A request is what a connector would send for one prompt: its arrival time, the chain of block
hashes of its full blocks, and its prompt length in tokens. Hashes are 16 bytes, packed into one
``bytes`` (compact: a million requests fit in a few hundred MB).

Trace format (one JSON object per line; blank lines and ``#`` comments are skipped)::

    {"t": 12.5, "tokens": [128000, 791, 4320, ...]}
    {"t": 12.9, "prefix": [["sys-support", 1200], ["conv-17", 640]]}

``tokens`` are real token ids, hashed exactly as the store's ``ChainHasher`` does. ``prefix``
describes the prompt as *prefix groups*: ``[group, n]`` means "the first ``n`` tokens of the token
stream named ``group``". Two prompts share a block exactly when they agree on every group piece up
to its end, so a trace never has to carry the tokens themselves (a chat turn is
``[["sys-a", 1200], ["conv-17", 1840]]``, its next turn ``[["sys-a", 1200], ["conv-17", 2400]]``).
``t`` is seconds from any origin, in arrival order; the planner uses it only as the store's
clock for leases.

Synthetic generators (``generate(spec, block_tokens)``, spec ``"name:key=value,..."``) model the
reuse patterns the store is for; each states its reuse, and the planner reports the hit rate an
infinite cache would reach, so a result can be read against that ceiling:

* ``chat`` — multi-turn conversations over a few shared system prompts; turn k re-sends turns < k.
* ``sysprompt`` — single-turn requests sharing Zipf-popular system prompts.
* ``rag`` — a system prompt, then k documents drawn Zipf-popular from a corpus, then a question.
* ``agent`` — agent loops: each step re-sends the whole context plus the last tool output.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import ChainHasher

HASH_BYTES = 16
_PIECE = struct.Struct("<QII")  # group id, start, end


@dataclasses.dataclass(slots=True)
class Request:
    t: float           # arrival time, seconds
    hashes: bytes      # concatenated 16-byte block hashes, one per full block, in chain order
    tokens: int        # prompt length in tokens (a partial tail block is always recomputed)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) // HASH_BYTES

    def hash_list(self) -> list[bytes]:
        h = self.hashes
        return [h[i:i + HASH_BYTES] for i in range(0, len(h), HASH_BYTES)]


class TraceError(InvalidArgument):
    """A malformed trace line; the message names the file and line number."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        super().__init__(f"trace line {line}", f"{path}:{line}: {message}")


# -- hashing prefix groups -------------------------------------------------------------------------

def _group_id(group) -> int:
    """A 64-bit id for a group name, stable across processes (never Python's hash())."""
    return xxhash.xxh3_64_intdigest(str(group).encode())


def chain_groups(pieces: Sequence[tuple[int, int]], block_tokens: int) -> tuple[bytes, int]:
    """Block hashes of a prompt made of ``(group id, n tokens)`` pieces; returns (hashes, tokens).

    Block i hashes its parent's hash with the group pieces it covers, as (group, start, end)
    offsets into each group's token stream: equal pieces mean equal tokens, so equal hashes mean
    equal prefixes, as with real tokens.
    """
    out = bytearray()
    parent = b"kvstore-plan-root"
    block = bytearray()
    filled = 0
    total = 0
    for gid, n in pieces:
        start = 0
        while start < n:
            take = min(n - start, block_tokens - filled)
            block += _PIECE.pack(gid, start, start + take)
            start += take
            filled += take
            if filled == block_tokens:
                parent = xxhash.xxh3_128_digest(parent + bytes(block))
                out += parent
                block.clear()
                filled = 0
        total += n
    return bytes(out), total


# -- trace reader ----------------------------------------------------------------------------------

def read_trace(path: str, block_tokens: int, hash_seed: int = 0) -> Iterator[Request]:
    """Yield the requests of a JSONL trace; ``TraceError`` names the first bad line."""
    hasher = ChainHasher("xxh3_128", seed=hash_seed)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            yield _parse_line(s, path, lineno, hasher, block_tokens)


def _parse_line(s: str, path: str, lineno: int, hasher: ChainHasher, block_tokens: int) -> Request:
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise TraceError(path, lineno, f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, lineno, "each line must be a JSON object")
    t = obj.get("t", obj.get("timestamp"))
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise TraceError(path, lineno, "field 't' (timestamp, seconds) must be a number")
    if ("tokens" in obj) == ("prefix" in obj):
        raise TraceError(path, lineno, "give exactly one of 'tokens' (token ids) or 'prefix' ([group, n] pieces)")
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(x, int) and 0 <= x < 2**32 for x in tokens):
            raise TraceError(path, lineno, "field 'tokens' must be a list of token ids (0 <= id < 2**32)")
        hashes = b"".join(hasher.chain(tokens, block_tokens))
        return Request(float(t), hashes, len(tokens))
    pieces = obj["prefix"]
    if not isinstance(pieces, list):
        raise TraceError(path, lineno, "field 'prefix' must be a list of [group, n_tokens] pairs")
    parsed = []
    for i, p in enumerate(pieces):
        if (not isinstance(p, list) or len(p) != 2 or not isinstance(p[0], (str, int))
                or not isinstance(p[1], int) or isinstance(p[1], bool) or p[1] < 0):
            raise TraceError(path, lineno, f"prefix[{i}] must be [group, n_tokens] with n_tokens >= 0")
        parsed.append((_group_id(p[0]), p[1]))
    hashes, total = chain_groups(parsed, block_tokens)
    return Request(float(t), hashes, total)


def write_trace(path: str, records: Sequence[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


# -- synthetic generators --------------------------------------------------------------------------

def _zipf_choice(rng: np.random.Generator, n: int, s: float, size: int) -> np.ndarray:
    """Indices in [0, n) with Zipf(s) popularity (s=0: uniform)."""
    weights = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=weights / weights.sum())


def _session_steps(rng, starts, steps: int, gap_s: float) -> list[tuple[float, int, int]]:
    """``(time, session, step)`` for sessions starting at ``starts``, each taking ``steps`` steps
    an exponential ``gap_s`` apart, in time order (chat turns and agent steps alike)."""
    events = []
    for s, t in enumerate(starts):
        for k in range(steps):
            events.append((t, s, k))
            t += rng.exponential(gap_s)
    events.sort()
    return events


def _chat(rng, n, block_tokens, conversations=0, turns=8, system_prompts=4, system_tokens=1024,
          user_tokens=150, reply_tokens=350, rate=20.0, think_s=30.0, zipf=1.0):
    """Conversations arrive at ``rate``/s; turn k is sent ``think_s`` (exp.) after turn k-1 and
    re-sends the system prompt and every earlier turn: reuse grows with turns."""
    conversations = conversations or max(1, n // turns)
    starts = np.cumsum(rng.exponential(1.0 / rate, conversations))
    sys_of = _zipf_choice(rng, system_prompts, zipf, conversations)
    for t, c, k in _session_steps(rng, starts, turns, think_s)[:n]:
        history = k * (user_tokens + reply_tokens) + user_tokens
        pieces = [(_group_id(f"sys-{sys_of[c]}"), system_tokens), (_group_id(f"conv-{c}"), history)]
        yield Request(float(t), *chain_groups(pieces, block_tokens))


def _sysprompt(rng, n, block_tokens, system_prompts=32, system_tokens=2048, user_tokens=200,
               rate=50.0, zipf=1.1):
    """Single-turn requests: a Zipf-popular system prompt plus a unique question."""
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    which = _zipf_choice(rng, system_prompts, zipf, n)
    for i in range(n):
        pieces = [(_group_id(f"sys-{which[i]}"), system_tokens), (_group_id(f"q-{i}"), user_tokens)]
        yield Request(float(times[i]), *chain_groups(pieces, block_tokens))


def _rag(rng, n, block_tokens, documents=5000, docs_per_request=4, doc_tokens=1024,
         system_tokens=512, user_tokens=100, rate=50.0, zipf=1.0):
    """A fixed system prompt, then ``docs_per_request`` Zipf-popular documents (in retrieval
    order: a document is only reusable as a prefix when everything before it matches too)."""
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    docs = _zipf_choice(rng, documents, zipf, n * docs_per_request).reshape(n, docs_per_request)
    sys_gid = _group_id("rag-sys")
    for i in range(n):
        pieces = [(sys_gid, system_tokens)] + [(_group_id(f"doc-{d}"), doc_tokens) for d in docs[i]]
        pieces.append((_group_id(f"q-{i}"), user_tokens))
        yield Request(float(times[i]), *chain_groups(pieces, block_tokens))


def _agent(rng, n, block_tokens, steps=20, system_tokens=3000, task_tokens=300, tool_tokens=400,
           rate=2.0, step_s=3.0):
    """Agent loops: a session re-sends its whole context each step, plus the last tool output
    (reuse approaches (steps-1)/steps of the context)."""
    sessions = max(1, n // steps)
    starts = np.cumsum(rng.exponential(1.0 / rate, sessions))
    sys_gid = _group_id("agent-sys")
    for t, s, k in _session_steps(rng, starts, steps, step_s)[:n]:
        pieces = [(sys_gid, system_tokens), (_group_id(f"agent-{s}"), task_tokens + k * tool_tokens)]
        yield Request(float(t), *chain_groups(pieces, block_tokens))


GENERATORS = {"chat": _chat, "sysprompt": _sysprompt, "rag": _rag, "agent": _agent}


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``"chat:turns=8,rate=20"`` -> ("chat", {"turns": 8, "rate": 20.0})."""
    name, _, rest = spec.partition(":")
    if name not in GENERATORS:
        raise InvalidArgument("workload", f"unknown generator {name!r}; one of {sorted(GENERATORS)}")
    params: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise InvalidArgument("workload", f"{item!r} is not key=value")
        try:
            num = float(value)
        except ValueError:
            raise InvalidArgument(f"workload.{key}", f"{value!r} is not a number") from None
        params[key] = int(num) if num.is_integer() and key not in ("rate", "think_s", "step_s", "zipf") else num
    code = GENERATORS[name].__code__
    allowed = set(code.co_varnames[3:code.co_argcount])
    unknown = set(params) - allowed - {"requests", "seed"}
    if unknown:
        raise InvalidArgument("workload", f"{name} has no parameter {sorted(unknown)}; it takes {sorted(allowed)}")
    return name, params


def generate(spec: str, block_tokens: int, requests: int | None = None, seed: int = 0) -> Iterator[Request]:
    """Requests of a synthetic workload, deterministic for a given spec and seed."""
    name, params = parse_spec(spec)
    n = int(params.pop("requests", requests or 10_000))
    seed = int(params.pop("seed", seed))
    return GENERATORS[name](np.random.default_rng(seed), n, block_tokens, **params)


def load(workload: str, block_tokens: int, requests: int | None = None, seed: int = 0) -> list[Request]:
    """A trace path (``*.jsonl`` or an existing file) or a generator spec, as a list."""
    import os
    if workload.endswith(".jsonl") or os.path.exists(workload):
        reqs = list(read_trace(workload, block_tokens))
        return reqs[:requests] if requests else reqs
    return list(generate(workload, block_tokens, requests, seed))
