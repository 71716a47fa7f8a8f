"""Hypothesis-driven fuzz of request fields against a real daemon: every answer is a defined status
(never INTERNAL / UNKNOWN), and the daemon keeps serving."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS}
LAYOUT = KVLayout(model="test/fuzz", num_layers=1, num_kv_heads=1, head_dim=8, dtype="uint8", block_tokens=4)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


_LOG: list = []  # the daemon's log reader, quoted when an answer is undefined


@pytest.fixture(scope="module")
def rig(kv_daemon):
    _LOG[:] = [lambda: kv_daemon.log()[-4000:]]
    channel = grpc.insecure_channel(kv_daemon.address, options=[("grpc.max_send_message_length", 64 << 20)])
    with kv_daemon.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
    yield pb_grpc.KVStoreStub(channel), ns, channel
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert kv_daemon.alive()
    channel.close()


def _answer(call) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)  # drain a stream
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def _check(call) -> None:
    code, details = _answer(call)
    assert code in DEFINED, (code, details, _LOG[0]() if _LOG else "")


hashes_st = st.lists(st.binary(max_size=80), max_size=12)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)


@st.composite
def namespace_ids(draw, valid: bytes):
    return draw(st.one_of(st.just(valid), st.binary(max_size=40)))


def _target(rig, data) -> tuple:
    """The stub, a namespace id (the rig's, or any bytes) and a hash list: what every call names."""
    stub, ns, _ = rig
    return stub, data.draw(namespace_ids(ns)), data.draw(hashes_st)


@FUZZ
@given(data=st.data())
def test_fuzz_reads(rig, data):
    stub, ns_id, hashes = _target(rig, data)
    _check(lambda: stub.Lookup(pb.LookupRequest(namespace_id=ns_id, hashes=hashes, no_lease=data.draw(st.booleans())),
                               timeout=10))
    _check(lambda: stub.Exists(pb.ExistsRequest(namespace_id=ns_id, hashes=hashes), timeout=10))
    _check(lambda: stub.Get(pb.GetRequest(namespace_id=ns_id, hashes=hashes, block_bytes=data.draw(u64),
                                          chunk_bytes=data.draw(u32)), timeout=10))
    _check(lambda: stub.PrepareLoad(pb.PrepareLoadRequest(namespace_id=ns_id, hashes=hashes,
                                                          block_bytes=data.draw(st.sampled_from([0, 32, 33]))),
                                    timeout=10))
    _check(lambda: stub.CompleteLoad(pb.LeaseRequest(lease_id=data.draw(u64)), timeout=10))
    _check(lambda: stub.LookupBatch(pb.LookupBatchRequest(requests=[pb.LookupRequest(namespace_id=ns_id, hashes=hashes)]
                                                          * data.draw(st.integers(0, 3))), timeout=10))
    _check(lambda: stub.BulkGet(pb.BulkRequest(namespace_id=ns_id, hashes=hashes, session=data.draw(st.binary(max_size=20))),
                                timeout=10))


@FUZZ
@given(data=st.data())
def test_fuzz_writes(rig, data):
    stub, ns_id, hashes = _target(rig, data)
    parent = data.draw(st.binary(max_size=80))
    sizes = data.draw(st.lists(st.sampled_from([0, 1, 31, 32, 48, 2**40]), max_size=4))   # client-encoded payloads
    header = pb.PutHeader(namespace_id=ns_id, hashes=hashes, parent=parent,
                          block_bytes=data.draw(st.sampled_from([0, 32, 31, 2**40])), codec=data.draw(st.integers(0, 3)),
                          sizes=sizes)
    datas = data.draw(st.lists(st.binary(max_size=100), max_size=4))
    with_header = data.draw(st.booleans())
    extra_header = data.draw(st.booleans())

    def stream():
        if with_header:
            yield pb.PutChunk(header=header, data=datas[0] if datas else b"")
        for d in datas[1:]:
            yield pb.PutChunk(data=d)
        if extra_header:
            yield pb.PutChunk(header=header)

    _check(lambda: stub.Put(stream(), timeout=10))
    _check(lambda: stub.PrepareStore(pb.PrepareStoreRequest(namespace_id=ns_id, hashes=hashes, parent=parent),
                                     timeout=10))
    _check(lambda: stub.CompleteStore(pb.LeaseRequest(lease_id=data.draw(u64)), timeout=10))
    try:   # a real lease, completed with fuzzed client-encoded payload fields
        lease = stub.PrepareStore(pb.PrepareStoreRequest(namespace_id=ns_id, hashes=hashes), timeout=10)
    except grpc.RpcError:
        lease = None
    if lease is not None:
        _check(lambda: stub.CompleteStore(pb.LeaseRequest(lease_id=lease.lease_id, codec=data.draw(st.integers(0, 7)),
                                                          sizes=sizes), timeout=10))
    _check(lambda: stub.AbortStore(pb.LeaseRequest(lease_id=data.draw(u64)), timeout=10))
    _check(lambda: stub.Delete(pb.DeleteRequest(namespace_id=ns_id, hashes=hashes), timeout=10))
    _check(lambda: stub.BulkPut(pb.BulkRequest(namespace_id=ns_id, hashes=hashes, block_bytes=data.draw(u64),
                                               session=data.draw(st.binary(max_size=20)),
                                               codec=data.draw(st.integers(0, 3)), sizes=sizes), timeout=10))


@FUZZ
@given(layout=st.builds(pb.Layout, model=st.text(max_size=300), num_layers=u32, num_kv_heads=u32, head_dim=u32,
                        dtype=st.sampled_from(["bfloat16", "float8_e4m3fn", "", "float7", "x" * 300]),
                        block_tokens=u32, layout=st.text(max_size=20), kv_per_token=st.integers(0, 3),
                        tp_rank=st.integers(0, 9), tp_size=st.integers(0, 9), block_bytes=u64),
       salt=st.text(max_size=300), has_layout=st.booleans())
def test_fuzz_register_namespace(rig, layout, salt, has_layout):
    stub, _, _ = rig
    req = pb.RegisterNamespaceRequest(cache_salt=salt, layout=layout if has_layout else None)
    _check(lambda: stub.RegisterNamespace(req, timeout=10))


def test_malformed_and_oversized_messages(rig, kv_daemon):
    stub, ns, channel = rig
    raw = channel.unary_unary("/kvstore.v1.KVStore/Lookup", request_serializer=None, response_deserializer=None)
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256))):
        with pytest.raises(grpc.RpcError) as e:
            raw(garbage, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request: not a valid kvstore.v1.LookupRequest" in e.value.details()
    raw_put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None, response_deserializer=None)
    first = pb.PutChunk(header=pb.PutHeader(namespace_id=ns, hashes=[b"\x01" * 16])).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        raw_put(iter([first, b"\xff\xff\xff"]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PutChunk" in e.value.details()
    too_big = pb.PutChunk(header=pb.PutHeader(namespace_id=ns, hashes=[b"\x01" * 16]), data=b"\0" * (20 << 20))
    with pytest.raises(grpc.RpcError) as e:
        stub.Put(iter([too_big]), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(namespace_id=ns, hashes=[b"\x01" * 16] * 5000), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hashes" in e.value.details()
    assert kv_daemon.alive()
