"""Run in the vLLM venv by bench_output_diffs.py: one chat request's greedy text under the ways a
serving run can compute it, with no connector (vLLM's own prefix cache only).

    python output_diffs_driver.py JOB.json RESULT.json

JOB: ``model``, ``block`` (vLLM's block size, as the serving runs had), ``rows`` (the chat
dataset's rows, in order), ``requests`` (indices to examine) and ``earlier`` (for each, the index
of the turn it extends). Per request, three experiments:

* ``cached``: alone, with vLLM's prefix cache holding exactly its first N tokens, every N (a
  multiple of the block) from 0 (a full prefill) to the last full block;
* ``batched``: a full prefill alone, and batched in one step with each other request's prefill;
* ``history``: alone, reusing the prefix its earlier turn computed when that turn ran alone or
  batched with each other request.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        job = json.load(f)
    block = job["block"]
    llm = LLM(model=job["model"], dtype="bfloat16", block_size=block, max_model_len=2048, enforce_eager=True,
              seed=0, enable_prefix_caching=True)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(row["conversations"][0]["value"]).input_ids for row in job["rows"]]
    greedy = SamplingParams(temperature=0, max_tokens=job.get("output_len", 16), ignore_eos=True)
    one_token = SamplingParams(temperature=0, max_tokens=1)

    def text(*prompts: int, cache_first: list[int] | None = None) -> tuple[str, int]:
        """The first prompt's text when ``prompts`` run in one batch after a fresh prefix cache
        (filled with ``cache_first`` computed first, if given)."""
        llm.reset_prefix_cache()
        if cache_first:
            llm.generate([TokensPrompt(prompt_token_ids=cache_first)], one_token, use_tqdm=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids[p]) for p in prompts], greedy, use_tqdm=False)[0]
        return out.outputs[0].text, out.num_cached_tokens

    result = {}
    for i, k in zip(job["requests"], job["earlier"]):
        others = [j for j in range(len(ids)) if j != i]
        cached = []
        for n in range(0, len(ids[i]), block):
            t, hit = text(i, cache_first=ids[i][:n] if n else None)
            cached.append({"cached_tokens": hit, "text": t})
        batched = [{"with": None, "text": text(i)[0]}] + [{"with": j, "text": text(i, j)[0]} for j in others]
        history = []
        for j in [None] + [j for j in others if j != k]:
            llm.reset_prefix_cache()
            llm.generate([TokensPrompt(prompt_token_ids=ids[p]) for p in ([k] if j is None else [k, j])], greedy,
                         use_tqdm=False)   # the earlier turn fills the cache, alone or batched with j
            out = llm.generate([TokensPrompt(prompt_token_ids=ids[i])], greedy, use_tqdm=False)[0]
            history.append({"earlier_batched_with": j, "cached_tokens": out.num_cached_tokens,
                            "text": out.outputs[0].text})
        result[str(i)] = {"prompt_tokens": len(ids[i]), "earlier": k, "cached": cached, "batched": batched,
                          "history": history}
        print(i, "done", flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
