"""Daemon settings: one file (YAML or TOML) + ``KVSTORE_*`` environment variables + CLI flags.

Precedence, highest first: **flags > environment > file > defaults**. The file is named by
``--config FILE`` or ``KVSTORE_CONFIG``. Nested keys use ``__`` in the environment
(``KVSTORE_FLEET__ENABLED=true``); dict-valued keys take JSON there
(``KVSTORE_TOKENS='{"s3cret": "team-a"}'``). Sizes accept units: ``4GiB``, ``512MiB``, ``1.5GB``,
``65536``. Every value is validated at start; a bad one is reported with its key and the allowed
range, and the daemon refuses to start (see docs/config.md for every knob).
"""

from __future__ import annotations

import json
import os
import tomllib
from typing import Annotated, Any, Literal, Union

import psutil
import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, SecretStr, Tag,
                      ValidationError, field_validator)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvstore.errors import KVStoreError
from kvstore.redis_connection import url_problem
from kvstore.units import GiB, KiB, MiB, TiB, format_size, parse_size


class ConfigError(KVStoreError, ValueError):
    """A setting is invalid; the message names the key and what is allowed."""

    grpc_status = "INVALID_ARGUMENT"


Size = Annotated[int, BeforeValidator(parse_size)]


def default_cpu_bytes() -> int:
    """Conservative: a quarter of the RAM available now, at most 4 GiB, at least 64 MiB."""
    return max(64 * MiB, min(psutil.virtual_memory().available // 4, 4 * GiB))


def default_nvme_path() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvstore", "nvme")


def existing_parent(path: str) -> str:
    """``path`` itself, or its nearest ancestor that exists (whose filesystem would hold it)."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def default_nvme_bytes() -> int:
    """16 GiB, or half the free space of the filesystem that would hold the NVMe directory."""
    try:
        free = psutil.disk_usage(existing_parent(default_nvme_path())).free
    except OSError:
        return 16 * GiB
    return max(256 * MiB, min(16 * GiB, free // 2))


def _text_not_echoed(value: Any) -> Any:
    """A secret is whatever text it was written as (a YAML number too): it must never fail
    validation, because a validation error would echo it."""
    return value if value is None or isinstance(value, (str, SecretStr)) else str(value)


def _redis_url(v: str) -> str:
    if problem := url_problem(v):
        raise ValueError(problem)
    return v


RedisUrl = Annotated[str, AfterValidator(_redis_url)]


class FleetSettings(BaseModel):
    """Sharing blocks between daemons through a Redis directory (kvstore.fleet)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0"
    node_id: str = ""                 # default: the host name
    advertise_addr: str = ""          # default: the listen address; must be reachable by peers
    key_prefix: str = "kvs"
    heartbeat_s: float = Field(2.0, gt=0, le=300)
    ttl_s: float = Field(10.0, gt=0, le=3600)
    peer_fetch: bool = True
    peer_token: str | None = None     # a token of the same tenant on the peers, when they use auth
    peer_timeout_s: float = Field(2.0, gt=0, le=60)
    # shared by every daemon of the fleet; directory values are signed with it (required when enabled)
    secret: Annotated[SecretStr | None, BeforeValidator(_text_not_echoed)] = None
    peer_tls_ca: str | None = None    # CA (PEM file): talk to peers over TLS and check their certificates
    max_peer_clients: int = Field(64, ge=1, le=4096)   # open peer connections kept (least recently used go)


CodecName = Literal["raw", "fp8", "fp8_head", "int4_g32", "int4_g64", "int4_g128", "zstd", "int4_g64_k16", "int8",
                    "int8_had", "int4_g64_k16_had", "int8_kchan", "int4_g64_t0"]


class CodecSettings(BaseModel):
    """Codec per tier: blocks are encoded when they move into the tier and decoded on every read
    (kvstore.codecs). Layouts a codec cannot interpret, and blocks it cannot represent (NaN/Inf),
    are stored raw. Lossy codecs (fp8*, int4*) trade fidelity for capacity: see docs/codecs.md."""

    model_config = ConfigDict(extra="forbid")
    gpu: CodecName = "raw"
    cpu: CodecName = "raw"
    nvme: CodecName = "raw"


class RedisTierSettings(BaseModel):
    """A Redis (or Redis Cluster) tier below NVMe (kvstore.tiers.redis): a pool a fleet shares.
    Blocks demoted out of the last local tier land here instead of being dropped; in fleet mode
    a local miss is looked up in the pool before peers are asked."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    url: RedisUrl = "redis://127.0.0.1:6379/0"  # redis://, rediss://, unix:// or redis+cluster://
    cluster: bool = False                       # a Redis Cluster (same as a redis+cluster:// url)
    capacity_bytes: Size = Field(1 * GiB, ge=1 * MiB, le=1024 * TiB)   # this daemon's budget in the pool
    ttl_s: float = Field(3600.0, gt=0, le=30 * 86400)   # every key expires; refreshed on each read
    codec: CodecName = "raw"                    # blocks are encoded as they move into the pool
    key_prefix: str = Field("kvs", min_length=1, max_length=64, pattern=r"^[^{}\s]+$")
    socket_timeout_s: float = Field(2.0, gt=0, le=60)

    @property
    def connect_url(self) -> str:
        if self.cluster and self.url.startswith("redis://"):
            return "redis+cluster://" + self.url[len("redis://"):]
        return self.url


LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]

PolicyName = Literal["lru", "prefix", "s3fifo"]
TierName = Literal["gpu", "cpu", "nvme", "redis"]
# tags of the two forms of ``eviction_policy``; validation errors drop them from the key they name
_ONE_POLICY, _PER_TIER = "one policy", "per tier"
#: one policy for every tier (``s3fifo``), or per tier (``{cpu: s3fifo, nvme: lru}``; tiers not
#: named get ``prefix``)
EvictionPolicySetting = Annotated[
    Union[Annotated[PolicyName, Tag(_ONE_POLICY)], Annotated[dict[TierName, PolicyName], Tag(_PER_TIER)]],
    Discriminator(lambda v: _PER_TIER if isinstance(v, dict) else _ONE_POLICY)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_", env_nested_delimiter="__", extra="forbid",
                                      validate_default=True)

    listen: str = "127.0.0.1:7373"
    workers: int | None = Field(None, ge=1, le=256)   # None: sized from the cores (kvstore.threads)
    max_message_bytes: Size = Field(16 * MiB, ge=64 * KiB, le=1 * GiB)
    chunk_bytes: Size = Field(1 * MiB, ge=4 * KiB, le=8 * MiB)

    cpu_bytes: Size = Field(default_factory=default_cpu_bytes, ge=1 * MiB, le=64 * TiB)
    cpu_slot_bytes: Size = Field(256 * KiB, ge=4 * KiB, le=1 * GiB)
    shm_dir: str = "/dev/shm"
    nvme_path: str = Field(default_factory=default_nvme_path)
    nvme_bytes: Size = Field(default_factory=default_nvme_bytes, ge=0, le=1024 * TiB)
    gpu_bytes: Size = Field(0, ge=0, le=64 * TiB)
    gpu_device: str = "cuda"

    eviction_policy: EvictionPolicySetting = "prefix"
    write_through: bool = False
    promote_on_hit: bool = True
    lease_seconds: float = Field(5.0, gt=0, le=3600)
    codecs: CodecSettings = Field(default_factory=CodecSettings)

    tokens: dict[str, str] = Field(default_factory=dict)      # bearer token -> tenant
    quotas: dict[str, Size] = Field(default_factory=dict)     # tenant -> max stored bytes
    admin_tenants: list[str] = Field(default_factory=list)   # tenants whose tokens see store-wide Stats
    # and act on every namespace (kvstore ns / evict / pin / prewarm / reload)
    # the most bytes one tenant may pin (kvstore pin); None: a quarter of the CPU tier
    max_pinned_bytes_per_tenant: Size | None = Field(None, ge=0, le=64 * TiB)
    # the most of the CPU tier one tenant's open load leases may pin; None: half of it
    max_leased_bytes_per_tenant: Size | None = Field(None, ge=0, le=64 * TiB)
    max_namespaces_per_tenant: int = Field(1024, ge=1, le=1 << 20)
    max_block_bytes: Size = Field(64 * MiB, ge=4 * KiB, le=1 * GiB)   # and at most 1/4 of the smallest tier
    tls_cert: str | None = None
    tls_key: str | None = None

    # with tokens set, each tenant's blocks live in CPU segments of this size that only its clients
    # can map (kvstore.transport.segments); None: cpu_bytes / 64, between one slot and 256 MiB
    cpu_segment_bytes: Size | None = Field(None, ge=4 * KiB, le=64 * GiB)
    # with tokens set, the segment bytes one tenant's same-host clients may hold, current segments and
    # replaced ones they still map (kvstore.tiers.cpu); None: cpu_bytes
    max_held_segment_bytes_per_tenant: Size | None = Field(None, ge=0, le=64 * TiB)
    # slots of each tenant's same-host lookup index (kvstore.transport.lookup_index; 24 bytes each,
    # it indexes up to half as many blocks, past that lookups ask the daemon); 0: no index
    lookup_index_slots: int = Field(1 << 18, ge=0, le=1 << 28)
    metrics_port: int | None = Field(None, ge=0, le=65535)   # None = no endpoint, 0 = any free port
    metrics_host: str = "127.0.0.1"
    metrics_top_n: int = Field(10, ge=1, le=1000)   # per-tenant / per-namespace series kept; the rest is "other"
    log_level: Annotated[LogLevel, BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)] = "INFO"
    redis_tier: RedisTierSettings = Field(default_factory=RedisTierSettings)
    bulk_channel: bool = True
    fleet: FleetSettings = Field(default_factory=FleetSettings)

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{v!r} is not HOST:PORT (port 0..65535)")
        return v

    @field_validator("lookup_index_slots")
    @classmethod
    def _check_lookup_index_slots(cls, v: int) -> int:
        if v and (v < 8 or v & (v - 1)):
            raise ValueError(f"{v} is not 0 or a power of two >= 8")
        return v

    @field_validator("quotas")
    @classmethod
    def _check_quotas(cls, v: dict[str, int]) -> dict[str, int]:
        for tenant, n in v.items():
            if n < 0:
                raise ValueError(f"quota of tenant {tenant!r} must be >= 0")
        return v

    def model_post_init(self, _: Any) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        unknown = sorted(set(self.admin_tenants) - set(self.tokens.values()))
        if self.tokens and unknown:
            raise ValueError(f"admin_tenants: {unknown} have no token in tokens")

    @property
    def pinned_bytes_limit(self) -> int:
        """What one tenant may pin: ``max_pinned_bytes_per_tenant``, or a quarter of the CPU tier."""
        pinned = self.max_pinned_bytes_per_tenant
        return self.cpu_bytes // 4 if pinned is None else pinned

    @property
    def tier_codecs(self) -> dict[str, str]:
        """Tier name -> codec, for every tier whose codec is not raw."""
        named = {**self.codecs.model_dump(), "redis": self.redis_tier.codec}
        return {tier: codec for tier, codec in named.items() if codec != "raw"}

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # flags (init kwargs) > environment > file > defaults
        return (init_settings, env_settings, _FileSource(settings_cls))


class _FileSource(PydanticBaseSettingsSource):
    """Values from the config file chosen by ``load_settings`` (or ``KVSTORE_CONFIG``)."""

    path: str | None = None

    def get_field_value(self, field, field_name):  # pragma: no cover - whole-dict source
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _FileSource.path or os.environ.get("KVSTORE_CONFIG")
        return read_config_file(path) if path else {}


def read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror}") from e
    try:
        if path.endswith(".toml"):
            data = tomllib.loads(raw.decode())
        elif path.endswith((".yaml", ".yml")):
            data = yaml.safe_load(raw) or {}
        elif path.endswith(".json"):
            data = json.loads(raw)
        else:
            raise ConfigError(f"config: {path} must end in .yaml, .yml, .toml or .json")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: {path} is not valid: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of settings")
    return data


_SIZE_KEYS = {"max_message_bytes", "chunk_bytes", "cpu_bytes", "cpu_slot_bytes", "cpu_segment_bytes",
              "max_held_segment_bytes_per_tenant", "nvme_bytes", "gpu_bytes", "quotas", "max_block_bytes",
              "max_pinned_bytes_per_tenant", "max_leased_bytes_per_tenant"}


# Settings that hold secrets. A bad value must not be echoed, nor, under ``tokens`` (token ->
# tenant), the key: the key *is* the token.
_SECRET_KEYS = {"tokens", "peer_token", "secret", "url", "redis_url"}   # a Redis URL may hold a password


def _redacted(loc: tuple) -> tuple[list[str], bool]:
    """The error location safe to print, and whether it lies under a secret setting."""
    parts = [str(p) for p in loc]
    for i, part in enumerate(parts):
        if part in _SECRET_KEYS:
            return parts[:i + 1] + [p if p == "[key]" else "<redacted>" for p in parts[i + 1:]], True
    return parts, False


def _describe(error: dict) -> str:
    error = {**error, "loc": tuple(p for p in error["loc"] if p not in (_ONE_POLICY, _PER_TIER))}
    loc, secret = _redacted(error["loc"])
    if not secret and loc[-1:] == ["[key]"]:   # a mapping's key is what is wrong: name it, not "[key]"
        return f"{'.'.join(loc[:-1])}: unknown key: {error['msg']}"
    key = ".".join(loc) or "config"
    ctx = error.get("ctx") or {}
    sized = error["loc"] and error["loc"][0] in _SIZE_KEYS
    bounds = [f"{op} {format_size(v) if sized and isinstance(v, int) and v >= 4096 else v}"
              for op, name in ((">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt"))
              if (v := ctx.get(name)) is not None]
    allowed = f" (allowed: {', '.join(bounds)})" if bounds else ""
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown setting; see docs/config.md for the known ones"
    if not error["loc"]:  # a check across settings: its input is the whole config, tokens included
        return f"{key}: {error['msg']}"
    got = "<redacted>" if secret else repr(error.get("input"))
    return f"{key}: {error['msg']}{allowed}; got {got}"


def load_settings(config_file: str | None = None, **flags: Any) -> Settings:
    """Settings from defaults < file < environment < ``flags`` (None-valued flags are ignored)."""
    flags = {k: v for k, v in flags.items() if v is not None}
    _FileSource.path = config_file
    try:
        return Settings(**flags)
    except ValidationError as e:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(_describe(err) for err in e.errors())) from None
    except ValueError as e:  # model_post_init and size parsing outside a field
        raise ConfigError(f"invalid configuration: {e}") from None
    finally:
        _FileSource.path = None
