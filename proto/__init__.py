"""The wire contract (installed as ``kvstore.proto``): ``kvstore.proto`` and the stubs generated
from it by ``scripts/gen_proto.py`` (``kvstore_pb2``, ``kvstore_pb2_grpc``, ``kvstore_pb2.pyi``;
never edited by hand, a test checks they are current). It owns the messages and the service
definition both ends speak. It imports only protobuf and grpc and must not import anything of
kvstore outside itself (the gRPC stub imports only its sibling ``kvstore.proto.kvstore_pb2``); the
client's and the daemon's code import it, never the reverse.
"""
