from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STORED: _ClassVar[PutResult]
    PUT_EXISTS: _ClassVar[PutResult]
    PUT_PERSISTED: _ClassVar[PutResult]
PUT_STORED: PutResult
PUT_EXISTS: PutResult
PUT_PERSISTED: PutResult

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("nonce", "client_version")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    client_version: int
    def __init__(self, nonce: _Optional[bytes] = ..., client_version: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("server_version", "server_id", "arena_path", "arena_bytes", "arena_dev", "arena_ino", "probe_path", "lease_seconds", "max_message_bytes", "chunk_bytes", "bulk_port", "bulk_ticket", "tenant", "stored_codecs", "segment_socket", "segment_ticket", "segment_bytes", "lookup_socket", "lookup_ticket", "lease_socket", "lease_ticket", "fleet_node")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_DEV_FIELD_NUMBER: _ClassVar[int]
    ARENA_INO_FIELD_NUMBER: _ClassVar[int]
    PROBE_PATH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STORED_CODECS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_TICKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TICKET_FIELD_NUMBER: _ClassVar[int]
    LEASE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LEASE_TICKET_FIELD_NUMBER: _ClassVar[int]
    FLEET_NODE_FIELD_NUMBER: _ClassVar[int]
    server_version: int
    server_id: str
    arena_path: str
    arena_bytes: int
    arena_dev: int
    arena_ino: int
    probe_path: str
    lease_seconds: float
    max_message_bytes: int
    chunk_bytes: int
    bulk_port: int
    bulk_ticket: bytes
    tenant: str
    stored_codecs: _containers.RepeatedScalarFieldContainer[int]
    segment_socket: str
    segment_ticket: bytes
    segment_bytes: int
    lookup_socket: str
    lookup_ticket: bytes
    lease_socket: str
    lease_ticket: bytes
    fleet_node: str
    def __init__(self, server_version: _Optional[int] = ..., server_id: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., arena_dev: _Optional[int] = ..., arena_ino: _Optional[int] = ..., probe_path: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., bulk_port: _Optional[int] = ..., bulk_ticket: _Optional[bytes] = ..., tenant: _Optional[str] = ..., stored_codecs: _Optional[_Iterable[int]] = ..., segment_socket: _Optional[str] = ..., segment_ticket: _Optional[bytes] = ..., segment_bytes: _Optional[int] = ..., lookup_socket: _Optional[str] = ..., lookup_ticket: _Optional[bytes] = ..., lease_socket: _Optional[str] = ..., lease_ticket: _Optional[bytes] = ..., fleet_node: _Optional[str] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "layout", "kv_per_token", "tp_rank", "tp_size", "pp_rank", "pp_size", "cp_rank", "cp_size", "block_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    layout: str
    kv_per_token: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    block_bytes: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., layout: _Optional[str] = ..., kv_per_token: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., cp_rank: _Optional[int] = ..., cp_size: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("layout", "cache_salt", "tenant")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    cache_salt: str
    tenant: str
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes", "tenant")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    tenant: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes", "no_lease", "producer", "local_only")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NO_LEASE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    no_lease: bool
    producer: str
    local_only: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ..., no_lease: _Optional[bool] = ..., producer: _Optional[str] = ..., local_only: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit", "tiers")
    NUM_HIT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_hit: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_hit: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[LookupRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[LookupRequest, _Mapping]]] = ...) -> None: ...

class LookupBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[LookupResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[LookupResponse, _Mapping]]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NodeRoute(_message.Message):
    __slots__ = ("node_id", "address", "blocks", "tokens", "memory_blocks", "disk_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    blocks: int
    tokens: int
    memory_blocks: int
    disk_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., blocks: _Optional[int] = ..., tokens: _Optional[int] = ..., memory_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRoute]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeRoute, _Mapping]]] = ...) -> None: ...

class PeerChecksumsRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PeerChecksumsResponse(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, signed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace_id", "hashes", "parent", "block_bytes", "codec", "sizes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    block_bytes: int
    codec: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., codec: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, str]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes", "block_bytes", "chunk_bytes", "accept_codecs", "range_offset", "range_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_CODECS_FIELD_NUMBER: _ClassVar[int]
    RANGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_bytes: int
    chunk_bytes: int
    accept_codecs: _containers.RepeatedScalarFieldContainer[int]
    range_offset: int
    range_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ..., block_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., accept_codecs: _Optional[_Iterable[int]] = ..., range_offset: _Optional[int] = ..., range_bytes: _Optional[int] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("index", "hit", "codec", "size", "offset", "data", "sizes", "codecs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    index: int
    hit: bool
    codec: int
    size: int
    offset: int
    data: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    codecs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., hit: _Optional[bool] = ..., codec: _Optional[int] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., codecs: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes", "parent", "block_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    block_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class PrepareLoadRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes", "block_bytes", "accept_codecs")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_CODECS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_bytes: int
    accept_codecs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ..., block_bytes: _Optional[int] = ..., accept_codecs: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("extent_counts", "offsets", "lengths", "generations", "codecs", "sizes", "present")
    EXTENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    extent_counts: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    codecs: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, extent_counts: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., codecs: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., present: _Optional[_Iterable[bool]] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in", "table")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in: float
    table: BlockTable
    def __init__(self, lease_id: _Optional[int] = ..., expires_in: _Optional[float] = ..., table: _Optional[_Union[BlockTable, _Mapping]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id", "codec", "sizes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    codec: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., codec: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class BulkRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes", "parent", "block_bytes", "session", "accept_codecs", "codec", "sizes", "range_offset", "range_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_CODECS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    RANGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    block_bytes: int
    session: bytes
    accept_codecs: _containers.RepeatedScalarFieldContainer[int]
    codec: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    range_offset: int
    range_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., session: _Optional[bytes] = ..., accept_codecs: _Optional[_Iterable[int]] = ..., codec: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ..., range_offset: _Optional[int] = ..., range_bytes: _Optional[int] = ...) -> None: ...

class BulkGetResponse(_message.Message):
    __slots__ = ("sizes", "codecs")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    codecs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., codecs: _Optional[_Iterable[int]] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace_id", "tenant", "layout", "cache_salt", "blocks", "bytes", "tiers", "pinned_blocks", "pinned_bytes", "lookup_blocks", "lookup_hits", "last_used")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierUsage
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierUsage, _Mapping]] = ...) -> None: ...
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    tenant: str
    layout: Layout
    cache_salt: str
    blocks: int
    bytes: int
    tiers: _containers.MessageMap[str, TierUsage]
    pinned_blocks: int
    pinned_bytes: int
    lookup_blocks: int
    lookup_hits: int
    last_used: float
    def __init__(self, namespace_id: _Optional[bytes] = ..., tenant: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., cache_salt: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., tiers: _Optional[_Mapping[str, TierUsage]] = ..., pinned_blocks: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., last_used: _Optional[float] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class NamespaceRequest(_message.Message):
    __slots__ = ("namespace_id",)
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ...) -> None: ...

class PrefixRequest(_message.Message):
    __slots__ = ("namespace_id", "hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AdminResponse(_message.Message):
    __slots__ = ("blocks", "bytes", "stored", "skipped", "fetched", "warmed")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    WARMED_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    stored: int
    skipped: int
    fetched: int
    warmed: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., stored: _Optional[int] = ..., skipped: _Optional[int] = ..., fetched: _Optional[int] = ..., warmed: _Optional[int] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("applied", "ignored")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.RepeatedScalarFieldContainer[str]
    ignored: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, applied: _Optional[_Iterable[str]] = ..., ignored: _Optional[_Iterable[str]] = ...) -> None: ...
