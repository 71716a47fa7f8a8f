"""A multi-turn chat dataset for vLLM's serving benchmark client (in its ``sharegpt`` format):
conversations about a pasted document, where each turn resends the conversation so far.

    python chat_dataset.py MODEL_DIR OUT.json --documents 0,1,2 --turns 4

Run in the vLLM venv (it renders prompts with the model's own chat template). Conversation ``d``
pastes document ``d`` of benchmarks/prompts/documents.jsonl with its first question; each later
turn appends the expected answer (as the assistant's reply) and the next question, as a chat
client resends the whole conversation. Rows are ordered turn by turn across the conversations
(every first turn, then every second, ...), so a turn arrives a few requests after the one it
extends; the client must keep that order (``--disable-shuffle``). Each row is a ShareGPT entry
whose first message is the rendered prompt (sent as is to /v1/completions) and whose second is the
expected answer, plus ``conversation``, ``turn`` and ``prompt_tokens``. (The ``custom`` JSONL
dataset would need pandas, which the vLLM venv does not have.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prompts.corpus import DOCUMENT_INSTRUCTION, HERE as CORPUS_DIR  # noqa: E402


def conversation_turns(document: dict, turns: int) -> list[list[dict]]:
    """The messages of each turn of a conversation about ``document`` (turn n holds n questions)."""
    questions = document["questions"][:turns]
    out = []
    for n in range(1, len(questions) + 1):
        messages = [{"role": "user",
                     "content": f"{DOCUMENT_INSTRUCTION}\n\n{document['text']}\n\nQuestion: {questions[0]['question']}"}]
        for q_prev, q in zip(questions[:n - 1], questions[1:n]):
            messages += [{"role": "assistant", "content": q_prev["answer"]},
                         {"role": "user", "content": f"Question: {q['question']}"}]
        out.append(messages)
    return out


def build(model_dir: str, documents: list[int], turns: int) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(CORPUS_DIR, "documents.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    per_conversation = {d: conversation_turns(docs[d], turns) for d in documents}
    rows = []
    for t in range(turns):
        for d in documents:
            if t < len(per_conversation[d]):
                prompt = tokenizer.apply_chat_template(per_conversation[d][t], tokenize=False, add_generation_prompt=True)
                answer = docs[d]["questions"][t]["answer"]
                rows.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
                             "conversation": docs[d]["id"], "turn": t + 1,
                             "prompt_tokens": len(tokenizer(prompt).input_ids)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--documents", default="0,1,2", help="indices into documents.jsonl, one conversation each")
    ap.add_argument("--turns", type=int, default=4)
    a = ap.parse_args()
    rows = build(a.model_dir, [int(x) for x in a.documents.split(",")], a.turns)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
