"""The real-text prompt corpus: documents with questions, code files with questions and tasks, and
multi-turn chats, written for this repository (nothing downloaded).

    from prompts.corpus import load_prompts     # from a script in benchmarks/
    prompts = load_prompts()                    # 257 prompts, each {"id", "kind", "group", "messages", "answer"}

* ``documents.jsonl``: 9 passages a user might paste (a leave policy, a kettle manual, a town's
  history, an incident postmortem, a lease, a bird survey, release notes, a recipe, meeting
  minutes), each with 12 questions whose short answer is a phrase of the passage (``answer``: the
  expected exact answer). One prompt per question, the passage first and the question last, so
  the 12 prompts of a document share every block of the passage.
* ``code.jsonl``: 5 source files (Python, JavaScript, Go, SQL) with 10 prompts each: questions
  with a short exact answer found in the file, and open tasks (write a test, explain, extend),
  whose ``answer`` is None. The file comes first, the request last.
* ``chats.jsonl``: 20 conversations of 4-5 user turns; each user turn is one prompt holding the
  conversation so far (earlier user turns and the assistant's replies written here), as a chat
  client resends it, so turn n+1's prompt extends turn n's.

``messages`` are chat messages (``{"role", "content"}``) for the model's own chat template; a
prompt's ``group`` names the document, file or conversation whose prefix it shares.
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

DOCUMENT_INSTRUCTION = ("Read the document below, then answer the question with a short phrase taken from the "
                        "document.")


def _read(name: str) -> list[dict]:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _prompt(kind: str, tag: str, group: str, i: int, messages: list[dict], answer: str | None) -> dict:
    return {"id": f"{tag}/{group}/{i}", "kind": kind, "group": group, "messages": messages, "answer": answer}


def document_prompts() -> list[dict]:
    return [_prompt("document", "doc", d["id"], i,
                    [{"role": "user", "content": f"{DOCUMENT_INSTRUCTION}\n\n{d['text']}\n\nQuestion: {q['question']}"}],
                    q["answer"])
            for d in _read("documents.jsonl") for i, q in enumerate(d["questions"])]


def code_prompts() -> list[dict]:
    return [_prompt("code", "code", c["id"], i,
                    [{"role": "user", "content": f"Here is `{c['path']}`:\n\n```{c['language']}\n{c['text']}```\n\n"
                                                 f"{t['prompt']}"}], t.get("answer"))
            for c in _read("code.jsonl") for i, t in enumerate(c["tasks"])]


def chat_prompts() -> list[dict]:
    """Turn n's prompt: the user turns and assistant replies up to that user turn."""
    return [_prompt("chat", "chat", c["id"], n // 2,
                    [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                     for i, t in enumerate(c["turns"][:n + 1])], None)   # turns: user, assistant, ..., user
            for c in _read("chats.jsonl") for n in range(0, len(c["turns"]), 2)]


def load_prompts() -> list[dict]:
    """Every prompt of the corpus: documents, then code, then chats (a fixed order)."""
    return document_prompts() + code_prompts() + chat_prompts()


def normalise(text: str) -> str:
    """Lower case, punctuation other than inside numbers dropped, whitespace collapsed: what exact
    match compares."""
    kept = []
    for i, ch in enumerate(text.lower()):
        inside_number = (ch in ".,:" and 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit())
        kept.append(ch if ch.isalnum() or ch.isspace() or inside_number else " ")
    return " ".join("".join(kept).split())


def exact_match(answer: str, generated: str) -> bool:
    """Whether the model's answer is the expected one: the first line of ``generated``, normalised,
    equals the expected answer or holds it as a whole phrase (a short reply such as "The rent is
    1,450 euros." counts; "14,500 euros" does not)."""
    first_line = next((line for line in generated.strip().splitlines() if line.strip()), "")
    got, want = f" {normalise(first_line)} ", f" {normalise(answer)} "
    return want.strip() != "" and want in got
