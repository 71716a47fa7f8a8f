"""Peer calls prove possession of their keys; no secret goes over the wire.

Whoever holds a peer's address (a signed directory entry written back after its node left, a port
taken over) must get nothing from a daemon that calls it: not the peer token, not a proof it can
use on an honest peer, and no bytes taken from it. So a fleet daemon calling a peer (Handshake,
RegisterNamespace, PeerChecksums, Get or BulkGet) sends

    authorization: KvsPeer <nonce hex> <ms> <request sha256 hex> <fleet mac hex> <token mac hex | ->

* ``nonce``: 16 fresh random bytes; ``ms``: the caller's clock;
* ``fleet mac``: keyed BLAKE2b under a key derived from the fleet secret over the nonce, the time,
  the callee's node id and epoch (from the signed entry the caller dialled), the method and the
  SHA-256 of the serialised request;
* ``token mac``: the same under a key derived from the fleet key and SHA-256(peer token); a callee
  with auth on finds the tenant from it (it holds its tokens' digests), one without auth ignores it.

The callee checks them against its own node id and epoch, the method called and the request bytes
that arrive, takes each nonce once within ``FRESH_MS`` of its time, and answers in its initial
metadata ``kvs-peer-proof: <mac>`` over the nonce, its node id, its epoch and the method under the
fleet key. The caller keeps no byte of an answer before that proof verifies for the node id and
epoch it meant to call. A captured header is good for one call, to one run of one node, with one
request; an entry written back for a run that left meets a callee that cannot prove it is that run.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
import time

import grpc

from kvstore.errors import Unauthenticated

SCHEME = "KvsPeer"
ANSWER_KEY = "kvs-peer-proof"              # initial metadata of a callee's answer
FRESH_MS = 30_000                          # clock skew and call time a proof may span
MAX_NONCES = 1 << 17                       # nonces a callee remembers: 4,000 peer calls a second
METHODS = frozenset({"Handshake", "RegisterNamespace", "Get", "BulkGet", "PeerChecksums"})   # what peer fetch calls
_MAC_BYTES = 16


def _secret_bytes(secret) -> bytes:
    if secret is not None and hasattr(secret, "get_secret_value"):   # pydantic SecretStr
        secret = secret.get_secret_value()
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _mac(key: bytes, person: bytes, *parts: bytes) -> str:
    h = hashlib.blake2b(key=key, digest_size=_MAC_BYTES, person=person)
    for part in parts:   # length-prefixed: no two contexts serialise alike
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.hexdigest()


def token_key(fleet_key: bytes, token_digest: bytes) -> bytes:
    """The key a caller holding the token whose SHA-256 is ``token_digest`` proves itself with."""
    return hashlib.blake2b(token_digest, key=fleet_key, digest_size=32, person=b"kvs-peer-token").digest()


class PeerKeys:
    """The fleet key and, with a peer token, the token key. Neither secret is kept."""

    def __init__(self, secret, peer_token=None) -> None:
        self.fleet = hashlib.blake2b(_secret_bytes(secret), digest_size=32, person=b"kvs-peer-key").digest()
        if peer_token is not None and hasattr(peer_token, "get_secret_value"):
            peer_token = peer_token.get_secret_value()
        self.token = token_key(self.fleet, hashlib.sha256(peer_token.encode()).digest()) if peer_token else None

    def __repr__(self) -> str:
        return "PeerKeys(<secret>)"


def _call_parts(nonce: str, ms: str, node_id: str, epoch: int, method: str, digest: str) -> tuple[bytes, ...]:
    return tuple(x.encode() for x in (nonce, ms, node_id, str(epoch), method, digest))


def caller_header(keys: PeerKeys, node_id: str, epoch: int, method: str, request_digest: bytes,
                  nonce: bytes | None = None, ms: int | None = None) -> str:
    """The ``authorization`` value for one call of ``method`` to node ``node_id`` in run ``epoch``."""
    nonce_hex = (nonce or secrets.token_bytes(16)).hex()
    ms_text = str(int(time.time() * 1000) if ms is None else ms)
    parts = _call_parts(nonce_hex, ms_text, node_id, epoch, method, request_digest.hex())
    fleet_mac = _mac(keys.fleet, b"kvs-peer-caller", *parts)
    token_mac = _mac(keys.token, b"kvs-peer-caller", *parts) if keys.token else "-"
    return f"{SCHEME} {nonce_hex} {ms_text} {request_digest.hex()} {fleet_mac} {token_mac}"


def callee_answer(keys: PeerKeys, nonce_hex: str, node_id: str, epoch: int, method: str) -> str:
    return _mac(keys.fleet, b"kvs-peer-callee", *(x.encode() for x in (nonce_hex, node_id, str(epoch), method)))


class Claim:
    """A caller's header, parsed; nothing in it is trusted before ``PeerVerifier.admit``."""

    __slots__ = ("nonce", "ms", "digest", "fleet_mac", "token_mac")

    def __init__(self, value: str) -> None:
        fields = value.split(" ")
        if len(fields) != 5 or len(fields[0]) != 32 or not (fields[1].isascii() and fields[1].isdigit()) \
                or len(fields[1]) > 15 or len(fields[2]) != 64 or not value.isascii():
            raise Unauthenticated("authorization: a malformed peer proof")
        self.nonce, ms, self.digest, self.fleet_mac, self.token_mac = fields
        self.ms = int(ms)
        try:
            bytes.fromhex(self.nonce + self.digest)
        except ValueError:
            raise Unauthenticated("authorization: a malformed peer proof") from None


class PeerVerifier:
    """A callee's side: admits each peer proof once, names its tenant, and answers it."""

    scheme = SCHEME

    def __init__(self, keys: PeerKeys, node_id: str, epoch: int) -> None:
        self.keys = keys
        self.node_id = node_id
        self.epoch = epoch
        self.refused = 0
        # nonce -> (forget after ms, method): each admitted once; handlers find the method here
        self._nonces: collections.OrderedDict[str, tuple[int, str]] = collections.OrderedDict()
        self._token_keys: dict[bytes, bytes] = {}   # token digest -> token key
        self._lock = threading.Lock()

    def _parts(self, claim: Claim, method: str) -> tuple[bytes, ...]:
        return _call_parts(claim.nonce, str(claim.ms), self.node_id, self.epoch, method, claim.digest)

    def admit(self, value: str, method: str) -> Claim:
        """The claim of a fresh proof made for this node, this run and ``method`` (a full method
        path), its nonce now used; ``Unauthenticated`` otherwise."""
        try:
            return self._admit(value, method)
        except Unauthenticated:
            self.refused += 1
            raise

    def _admit(self, value: str, method: str) -> Claim:
        if method.rpartition("/")[2] not in METHODS:
            raise Unauthenticated(f"authorization: a peer proof is taken on {', '.join(sorted(METHODS))} only")
        claim = Claim(value)
        want = _mac(self.keys.fleet, b"kvs-peer-caller", *self._parts(claim, method))
        if not hmac.compare_digest(want, claim.fleet_mac):
            raise Unauthenticated("authorization: the peer proof does not verify for this node and run")
        now = int(time.time() * 1000)
        if abs(now - claim.ms) > FRESH_MS:
            raise Unauthenticated("authorization: the peer proof is not fresh")
        with self._lock:
            while self._nonces and next(iter(self._nonces.values()))[0] < now:
                self._nonces.popitem(last=False)
            if claim.nonce in self._nonces:
                raise Unauthenticated("authorization: the peer proof was used before")
            if len(self._nonces) >= MAX_NONCES:
                raise Unauthenticated("authorization: too many peer calls at once")
            # kept while the claim stays fresh, and for the handlers of a call admitted just now
            self._nonces[claim.nonce] = (max(claim.ms, now) + FRESH_MS, method)
        return claim

    def tenant(self, value: str, digests) -> tuple[str, bytes]:
        """``(tenant, token digest)`` of an admitted proof whose token MAC verifies under one of
        ``digests`` (``(digest, tenant)`` pairs). Every digest is tried: no early exit."""
        claim = Claim(value)
        with self._lock:
            admitted = self._nonces.get(claim.nonce)
        if admitted is None:
            raise Unauthenticated("authorization: a peer proof that was not admitted")
        parts = self._parts(claim, admitted[1])
        found = None
        for digest, tenant in digests:
            key = self._token_keys.get(digest)
            if key is None:
                if len(self._token_keys) >= 4096:
                    self._token_keys.clear()
                key = self._token_keys[digest] = token_key(self.keys.fleet, digest)
            if hmac.compare_digest(_mac(key, b"kvs-peer-caller", *parts), claim.token_mac):
                found = (tenant, digest)
        if found is None:
            raise Unauthenticated("authorization: the peer proof names no known token")
        return found

    def answer(self, claim: Claim, method: str) -> tuple[str, str]:
        """The initial metadata that proves this node and run to the caller."""
        return ANSWER_KEY, callee_answer(self.keys, claim.nonce, self.node_id, self.epoch, method)


class PeerUnproven(Unauthenticated):
    """A peer did not prove it is the node and run its signed entry names: nothing it sent is kept."""


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class PeerProver(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A caller's side, as a gRPC client interceptor for the channel to one peer: every call
    carries a fresh proof for ``node_id`` / ``epoch``, and its answer is handed on only once the
    callee proved the same. Calls with a streamed request (Put) carry none."""

    def __init__(self, keys: PeerKeys, node_id: str, epoch: int) -> None:
        self.keys = keys
        self.node_id = node_id
        self.epoch = epoch

    def _prove(self, details, request) -> tuple[_Details, str, str]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        header = caller_header(self.keys, self.node_id, self.epoch, method,
                               hashlib.sha256(request.SerializeToString()).digest())
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != "authorization"]
        metadata.append(("authorization", header))
        return _Details(details, metadata), method, header.split(" ", 2)[1]

    def _proven(self, call, method: str, nonce: str) -> bool:
        got = dict(call.initial_metadata() or ()).get(ANSWER_KEY)
        want = callee_answer(self.keys, nonce, self.node_id, self.epoch, method)
        return isinstance(got, str) and hmac.compare_digest(got, want)

    def _unproven(self, method: str) -> PeerUnproven:
        return PeerUnproven(f"peer {self.node_id}: no proof that it is the node and run its signed entry "
                            f"names ({method.rpartition('/')[2]}); nothing it sent was kept")

    def intercept_unary_unary(self, continuation, client_call_details, request):
        details, method, nonce = self._prove(client_call_details, request)
        outcome = continuation(details, request)
        if not outcome.done():
            # a future (BulkGet: its answer waits on the caller reading the side channel, so it is
            # not waited for here): its answer is handed on once the proof, which comes with it
            # (a unary call's headers arrive with its answer), verifies
            return _ProvenAnswer(outcome, lambda: self._proven(outcome, method, nonce),
                                 lambda: self._unproven(method))
        if outcome.exception() is not None or self._proven(outcome, method, nonce):
            return outcome   # a refusal surfaces as itself: it carries no bytes
        raise self._unproven(method)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        details, method, nonce = self._prove(client_call_details, request)
        call = continuation(details, request)
        if self._proven(call, method, nonce):
            return call
        if not call.initial_metadata() and call.done() and call.code() != grpc.StatusCode.OK:
            return call      # refused before any header: the error surfaces, no message came
        call.cancel()
        raise self._unproven(method)


class _ProvenAnswer:
    """A unary call in flight (a grpc future) whose ``result`` and ``exception`` hand its answer on
    only once the callee's proof verifies; a refusal surfaces as itself. The rest is the call's."""

    def __init__(self, call, proven, unproven) -> None:
        self._call = call
        self._proven = proven
        self._unproven = unproven

    def result(self, timeout=None):
        answer = self._call.result(timeout)
        if not self._proven():
            raise self._unproven()
        return answer

    def exception(self, timeout=None):
        error = self._call.exception(timeout)
        if error is None and not self._proven():
            return self._unproven()
        return error

    def __getattr__(self, name):
        return getattr(self._call, name)
