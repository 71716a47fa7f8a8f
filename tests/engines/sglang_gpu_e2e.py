"""GPU end-to-end check: a real sglang Engine with kvstore as its HiCache L3 storage.

    python tests/engines/sglang_gpu_e2e.py [--model PATH]      # exits 0 with "SKIP" without CUDA

Run in an environment with a GPU build of sglang (0.5.23, with sgl-kernel) and kvstore
installed. It starts a real kvstore daemon, builds a small random Llama offline
(tests/engines/tiny_model.py; head_dim 128) unless --model is given, then:

1. generates greedily for a long prompt (pages are written through to the host pool and
   backed up to kvstore by SGLang's backup thread);
2. flushes SGLang's device and host caches (``Engine.flush_cache``), so only kvstore holds them;
3. generates again for the same prompt: SGLang must prefetch the prefix from kvstore
   (``meta_info.cached_tokens > 0``) and produce the same tokens.

Exit status 0 = pass (or skip), 1 = fail. Prints one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF model directory (default: a tiny random Llama built offline)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("SKIP sglang GPU end-to-end: no CUDA device")
        return 0
    try:
        import sglang as sgl
    except ImportError:
        print("SKIP sglang GPU end-to-end: sglang is not installed here")
        return 0

    sys.path.insert(0, os.path.join(REPO, "tests"))
    sys.path.insert(0, HERE)
    from daemon_util import start_daemon

    tmp = tempfile.mkdtemp(prefix="kvstore-sglang-e2e-")
    model = args.model
    if model is None:
        from tiny_model import build

        model = build(os.path.join(tmp, "model"), layers=4, hidden=512, heads=4, kv_heads=2,
                      intermediate=1024, vocab=4096)
    daemon = start_daemon(os.path.join(tmp, "kvd"), cpu_bytes="2GiB", nvme_bytes="0")
    result: dict = {"model": model}
    try:
        extra = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
                 "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "url": daemon.url}
        engine = sgl.Engine(model_path=model, skip_tokenizer_init=True, page_size=args.page_size,
                            enable_hierarchical_cache=True, hicache_ratio=2.0,
                            hicache_write_policy="write_through",
                            hicache_storage_backend="dynamic",
                            hicache_storage_backend_extra_config=json.dumps(extra),
                            hicache_storage_prefetch_policy="wait_complete",
                            mem_fraction_static=0.3, random_seed=0, log_level="warning")
        try:
            prompt = [(i * 7919 + 13) % 4000 + 10 for i in range(args.prompt_tokens)]
            params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
            first = engine.generate(input_ids=prompt, sampling_params=params)
            # SGLang's backup thread writes pages to kvstore asynchronously; give it time.
            time.sleep(5.0)
            client = daemon.client()
            flushed = engine.flush_cache()
            second = engine.generate(input_ids=prompt, sampling_params=params)
            result.update(first_tokens=first["output_ids"], second_tokens=second["output_ids"],
                          first_cached=first["meta_info"].get("cached_tokens"),
                          second_cached=second["meta_info"].get("cached_tokens"),
                          flush=str(flushed), daemon_stats=client.stats())
            client.close()
        finally:
            engine.shutdown()
    finally:
        daemon.stop()
    ok = (result["second_cached"] or 0) > 0 and result["first_tokens"] == result["second_tokens"]
    result["ok"] = ok
    print(json.dumps(result, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
