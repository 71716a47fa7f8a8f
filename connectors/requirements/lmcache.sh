# lmcache after torch (lmcache.txt), so the CPU torch is kept.
"$VENV/bin/python" -m pip install -q lmcache==0.5.6 torch==2.13.0
# kvstore's generated gRPC stubs need protobuf>=7.35 and grpcio>=1.85.1 at runtime. lmcache declares
# protobuf<7 (through opentelemetry/grpcio-status, which its storage paths do not use): its MP server
# and `lmcache bench l2` run with protobuf 7, as tests/test_lmcache_backend.py checks.
"$VENV/bin/python" -m pip install -q "protobuf>=7.35" "grpcio>=1.85.1" grpcio-health-checking xxhash \
    zstandard pydantic-settings "torch==2.13.0"
