"""The vLLM connector on a real pretrained model: SmolLM2-135M-Instruct (30 layers, bf16, built from
its PyPI wheel by scripts/real-model.sh) on real text, a real daemon, real vLLM-CPU engines.

1. ``first`` (connector on, vLLM's prefix caching on) answers "The capital of France is" with
   " Paris" (the model is the real one, not noise), reads three prompts (a document and a question
   about it; the connector saves their KV to the daemon), then answers them: vLLM's own prefix
   cache serves each prompt's full blocks, so these answers are the reference.
2. ``second`` (a fresh engine, prefix caching off: only the daemon can supply a prefix) answers the
   same prompts: their full blocks come from the daemon, and every greedy answer must be
   token-identical to the reference.

A loaded prefix is compared with vLLM's own prefix cache, not with a full prefill: bf16 attention
over a cached prefix is not bitwise a full prefill, and on this model the two differ in greedy
output on some prompts (issue 34), for vLLM's cache as much as for kvstore's.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402
from venvs import real_model  # noqa: E402

BLOCK = 32
ANSWER_TOKENS = 24

pytestmark = pytest.mark.timeout(900)

DOCUMENTS = [
    "The harbour town of Kestrel Bay was founded in 1742 by fishermen who followed the herring shoals north "
    "along the coast. For almost a century the town lived from the sea alone: its boats left before dawn, "
    "and the catch was salted in long sheds that still stand beside the old quay. In 1851 a railway line "
    "reached the town from the inland city of Marrow, and within ten years Kestrel Bay had become a resort. "
    "Hotels were built along the cliff road, a pier stretched three hundred metres into the bay, and a "
    "lighthouse, painted in red and white bands, was lit for the first time in 1863. The fishing fleet shrank "
    "as the tourists arrived; by 1900 only eleven boats remained. Today the town has about 6,400 residents. "
    "Its museum, housed in the former salting sheds, shows the nets, barrels and logbooks of the herring "
    "years, and every August the town holds a regatta in which the last working boats race the visitors' "
    "yachts around the lighthouse and back to the pier.\n\n",
    "Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical energy. "
    "It takes place mostly in the leaves, inside small structures called chloroplasts, which contain the green "
    "pigment chlorophyll. Chlorophyll absorbs red and blue light strongly and reflects green light, which is "
    "why leaves look green to us. The process has two stages. In the light-dependent reactions, energy from "
    "sunlight splits water molecules, releasing oxygen as a by-product and storing energy in two carrier "
    "molecules, ATP and NADPH. In the second stage, the Calvin cycle, the plant uses that stored energy to fix "
    "carbon dioxide from the air into sugars. A single mature tree can absorb roughly twenty kilograms of "
    "carbon dioxide in a year. Because photosynthesis releases oxygen, it is also the source of almost all the "
    "oxygen in the Earth's atmosphere, which began to accumulate about 2.4 billion years ago.\n\n",
    "def merge_intervals(intervals):\n"
    "    \"\"\"Merge overlapping closed intervals and return them sorted by start.\"\"\"\n"
    "    if not intervals:\n"
    "        return []\n"
    "    ordered = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = [list(ordered[0])]\n"
    "    for start, end in ordered[1:]:\n"
    "        last = merged[-1]\n"
    "        if start <= last[1]:\n"
    "            last[1] = max(last[1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return [tuple(pair) for pair in merged]\n\n\n"
    "def total_covered(intervals):\n"
    "    \"\"\"The total length covered by the intervals, counting overlaps once.\"\"\"\n"
    "    return sum(end - start for start, end in merge_intervals(intervals))\n\n\n"
    "print(merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18), (17, 20)]))\n"
    "print(total_covered([(1, 3), (2, 6), (8, 10)]))\n\n",
]
QUESTIONS = [
    "Question: In which year was the lighthouse of Kestrel Bay first lit?\nAnswer:",
    "Question: Which gas is released as a by-product when water molecules are split?\nAnswer:",
    "Question: What does the first print statement output?\nAnswer:",
]
PROMPTS = [d + q for d, q in zip(DOCUMENTS, QUESTIONS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from daemon_util import start_daemon

    model = real_model()
    python = vllm_runner.vllm_python()
    workdir = str(tmp_path_factory.mktemp("vllm-real"))
    daemon = start_daemon(tmp_path_factory.mktemp("kvd"))
    engine = {"model": model, "skip_tokenizer_init": False, "max_model_len": 2048,
              "kv_cache_memory_bytes": 256 * 2**20}
    kv = vllm_runner.kvstore_transfer_config(f"grpc://{daemon.url}", retry_after_s=30)
    try:
        (first,) = vllm_runner.run_jobs(python, workdir, [("first", {
            "engine": {**engine, "enable_prefix_caching": True}, "kv_transfer_config": kv,
            "steps": [{"generate": ["The capital of France is"], "max_tokens": 2},
                      {"generate": PROMPTS, "max_tokens": 1},
                      {"drain": True},
                      {"generate": PROMPTS, "max_tokens": ANSWER_TOKENS}]})], timeout_s=600)
        (second,) = vllm_runner.run_jobs(python, workdir, [("second", {
            "engine": {**engine, "enable_prefix_caching": False}, "kv_transfer_config": kv,
            "steps": [{"generate": PROMPTS, "max_tokens": ANSWER_TOKENS}]})], timeout_s=600)
    finally:
        daemon.kill()
    return first, second


def test_the_model_is_the_real_pretrained_one(runs):
    first, _ = runs
    assert first["steps"][0]["texts"][0].startswith(" Paris"), first["steps"][0]["texts"]


def test_a_fresh_engine_loads_real_text_prefixes_from_the_daemon(runs):
    first, second = runs
    lengths = first["steps"][1]["prompt_tokens"]
    reference, loaded = first["steps"][3], second["steps"][0]
    # vLLM's own cache served each prompt's full blocks (all but the last token's) in the first
    # engine; the second engine, with no cache of its own, got the same blocks from the daemon.
    full = [(n - 1) // BLOCK * BLOCK for n in lengths]
    assert min(full) >= 5 * BLOCK
    assert reference["num_cached_tokens"] == full
    assert loaded["num_cached_tokens"] == full
    assert second["connector"]["worker"]["loaded_blocks"] == sum(full) // BLOCK


def test_loaded_answers_are_token_identical_to_vllms_own_prefix_cache(runs):
    first, second = runs
    reference, loaded = first["steps"][3], second["steps"][0]
    assert loaded["outputs"] == reference["outputs"], (reference["texts"], loaded["texts"])
    assert all(len(o) == ANSWER_TOKENS for o in loaded["outputs"])
