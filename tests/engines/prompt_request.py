"""The part of vLLM's ``Request`` a connector's scheduler half reads, for drivers that call
``SchedulerSide`` without an engine (vllm_pd_pins.py, vllm_pd_admit.py, vllm_both_handoff.py):
a request whose tokens are its prompt (nothing generated yet)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class PromptRequest:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)
