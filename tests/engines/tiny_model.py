"""Build a small random Llama model on the fly (run inside an engine venv; never committed).

    python tiny_model.py OUT_DIR [--layers 2] [--hidden 128] [--heads 4] [--kv-heads 2]
                                 [--intermediate 256] [--vocab 1024] [--seed 0]

Random weights with a fixed seed are enough to test a KV connector: the output tokens are a
deterministic function of the KV, so any wrong byte loaded changes them. No tokenizer is written;
engines run with ``skip_tokenizer_init=True`` and token-id prompts.
"""

from __future__ import annotations

import argparse
import json
import os


def build(out_dir: str, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 256, vocab: int = 1024, seed: int = 0, max_positions: int = 4096) -> str:
    import fcntl

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent engines may build the same model
        return _build_locked(out_dir, layers, hidden, heads, kv_heads, intermediate, vocab, seed, max_positions)


def _build_locked(out_dir, layers, hidden, heads, kv_heads, intermediate, vocab, seed, max_positions) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = os.path.join(out_dir, "kvstore-tiny.json")
    spec = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                intermediate=intermediate, vocab=vocab, seed=seed, max_positions=max_positions)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == spec:
                return out_dir
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, vocab_size=vocab,
                         max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config)
    # Larger-than-default init so random logits are far from ties: a corrupted KV must
    # visibly change the argmax tokens, and a correct one must reproduce them exactly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(spec, f)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    for name, default in (("layers", 2), ("hidden", 128), ("heads", 4), ("kv-heads", 2),
                          ("intermediate", 256), ("vocab", 1024), ("seed", 0), ("max-positions", 4096)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    build(a.out_dir, a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab, a.seed, a.max_positions)
    print(a.out_dir)


if __name__ == "__main__":
    main()
