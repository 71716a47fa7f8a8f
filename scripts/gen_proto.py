#!/usr/bin/env python3
"""Regenerate proto/kvstore_pb2.py and proto/kvstore_pb2_grpc.py from proto/kvstore.proto.

The .proto is compiled from a temporary include root where it sits at kvstore/proto/kvstore.proto,
so the generated gRPC stub imports ``from kvstore.proto import kvstore_pb2`` (the installed package
name) instead of a bare ``import kvstore_pb2``. ``--check`` exits 1 if the checked-in files differ.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
OUTPUTS = ("kvstore_pb2.py", "kvstore_pb2_grpc.py", "kvstore_pb2.pyi")


def generate(out_dir: str) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as include:
        nested = os.path.join(include, "kvstore", "proto")
        os.makedirs(nested)
        shutil.copy(os.path.join(PROTO_DIR, "kvstore.proto"), nested)
        with tempfile.TemporaryDirectory() as gen:
            rc = protoc.main(["grpc_tools.protoc", f"-I{include}", f"--python_out={gen}",
                              f"--pyi_out={gen}", f"--grpc_python_out={gen}",
                              "kvstore/proto/kvstore.proto"])
            if rc != 0:
                raise SystemExit(f"protoc failed with exit code {rc}")
            for name in OUTPUTS:
                shutil.copy(os.path.join(gen, "kvstore", "proto", name), os.path.join(out_dir, name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the checked-in stubs are stale")
    args = ap.parse_args(argv)
    if not args.check:
        generate(PROTO_DIR)
        print("regenerated", ", ".join(OUTPUTS))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        stale = [n for n in OUTPUTS
                 if open(os.path.join(tmp, n), "rb").read() != open(os.path.join(PROTO_DIR, n), "rb").read()]
    if stale:
        print("stale generated files (run `make proto`):", ", ".join(stale), file=sys.stderr)
        return 1
    print("generated stubs are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
