"""The real-text prompt corpus the real-model benchmarks run on (benchmarks/prompts/): enough
prompts of each kind, answers that are really in their documents, shared prefixes, and the
exact-match scoring the fidelity benchmark uses."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(REPO, "benchmarks", "prompts")


def corpus():
    spec = importlib.util.spec_from_file_location("prompt_corpus", os.path.join(PROMPTS, "corpus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_at_least_256_prompts_of_three_kinds_in_a_modest_corpus():
    c = corpus()
    prompts = c.load_prompts()
    kinds = {k: sum(p["kind"] == k for p in prompts) for k in ("document", "code", "chat")}
    assert len(prompts) >= 256 and min(kinds.values()) >= 50, kinds
    assert len({p["id"] for p in prompts}) == len(prompts)
    on_disk = sum(os.path.getsize(os.path.join(PROMPTS, f)) for f in os.listdir(PROMPTS) if f.endswith(".jsonl"))
    assert on_disk < 300_000, on_disk


def test_every_expected_answer_is_a_phrase_of_its_prompt():
    """Exact match is only fair if the answer can be copied from the document or file."""
    c = corpus()
    answered = [p for p in c.load_prompts() if p["answer"] is not None]
    assert sum(p["kind"] == "document" for p in answered) >= 100
    for p in answered:
        assert p["answer"] in p["messages"][-1]["content"], p["id"]


def test_prompts_of_a_group_share_their_prefix():
    """Documents and code files come before the question, and each chat turn extends the one
    before: prefix blocks are reused across prompts, as in real traffic."""
    c = corpus()
    by_group: dict[str, list] = {}
    for p in c.load_prompts():
        by_group.setdefault(p["group"], []).append(p)
    for group, ps in by_group.items():
        if ps[0]["kind"] == "chat":
            for before, after in zip(ps, ps[1:]):
                assert after["messages"][:len(before["messages"])] == before["messages"], group
                assert len(after["messages"]) == len(before["messages"]) + 2
        else:
            assert len(ps) >= 10, group
            texts = [p["messages"][-1]["content"] for p in ps]
            shared = os.path.commonprefix(texts)
            assert len(shared) >= 0.8 * min(len(t) for t in texts), group


def test_exact_match_takes_the_answer_as_a_whole_phrase_of_the_first_line():
    c = corpus()
    assert c.exact_match("1,450 euros", "The monthly rent is 1,450 euros.")
    assert c.exact_match("Harbor", "harbor")
    assert c.exact_match("9:30", "Before 9:30 on the first day.")
    assert not c.exact_match("1,450 euros", "14,500 euros")
    assert not c.exact_match("27", "270 days")
    assert not c.exact_match("Harbor", "I don't know.\nHarbor")   # the first line only
