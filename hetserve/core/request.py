"""Request: one sequence being generated (an `n > 1` request fans out into n of these)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from hetserve.core.block_hash import BlockHash, CacheExtra
from hetserve.core.grammar import GrammarSpec
from hetserve.core.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its cached blocks are being loaded from a KV store
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside the engine; the other requests are unaffected

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class HandoffRole(enum.Enum):
    SEND = "send"  # a prefill instance: compute the prompt, then hand its KV over
    RECEIVE = "receive"  # a decode instance: wait for the KV, then generate


class HandoffPath(enum.Enum):
    STORE = "store"  # through the shared KV store, full blocks under their BlockHash
    DIRECT = "direct"  # pushed to the decode instance (shared memory on one host, else TCP)
    MOONCAKE = "mooncake"  # written by Mooncake's Transfer Engine into the receiver's staging


@dataclass(frozen=True)
class KVHandoff:
    """A request's part in a prefill -> decode hand-off: both sides get the same `key` (the
    Conductor makes it, unique per request). The prefill side hands over the KV of every
    prompt token but the last; the decode side computes the last one itself and samples from
    there, exactly as a colocated engine would."""

    key: str
    role: HandoffRole
    path: HandoffPath = HandoffPath.DIRECT
    peer: str | None = None  # SEND over DIRECT: the decode instance's receiver, host:port
    timeout_s: float = 30.0  # RECEIVE: after this, recompute instead


@dataclass(eq=False)
class PrefillSlice:
    """A prompt chunk that runs through the decoder layers over several steps (beside decodes,
    a few layers a step: sched/step_budget.py). Its KV blocks are allocated when it starts;
    its tokens count as computed only once the last layer has run."""

    tokens: int  # the chunk: this many tokens after the request's computed ones
    layer: int = 0  # decoder layers it has been through
    hidden: Any = None  # its hidden states after `layer` layers (the engine's tensor)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first (vLLM's convention); FCFS among equals
    cache_extra: CacheExtra = ()  # what changes the KV besides tokens: LoRA id, cache salt, ...
    session_id: str | None = None  # an agent's session: its blocks outlive it for a TTL
    lora_id: str | None = None  # the LoRA adapter it runs with (content id), None = base model
    kv_handoff: KVHandoff | None = None  # its part in a prefill/decode hand-off
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, in order
    num_preemptions: int = 0
    num_loads: int = 0  # loads of its blocks from a KV store so far
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # tier -> tokens loaded from it
    # Without a step limit: seconds the steps that carried its prompt's chunks took beyond
    # what the step budget allowed them (sched/step_budget.py), never below 0
    prefill_debt_s: float = 0.0
    # A prompt chunk part way through the decoder layers (the step budget's layer slices)
    prefill_slice: PrefillSlice | None = None
    # Speculative decoding: tokens drafted to follow it, checked in its next step (the engine
    # sets them before each step; the scheduler gives the step as many as fit)
    spec_token_ids: list[int] = field(default_factory=list)
    # What the output is expected to be, largely (OpenAI's Predicted Outputs): drafts follow it
    prediction: list[int] | None = None
    num_draft_tokens: int = 0  # drafts checked for it so far
    num_accepted_tokens: int = 0  # ... and those that held

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class NewRequest:
    """A request to generate, the one value every layer passes on: the server builds it
    (`serving.start`), `AsyncLLM.submit` has it validated in the caller's thread and hands it
    to the engine thread, `EngineCore.enqueue` queues it in the scheduler. A field that a role,
    a hand-off or a grammar adds goes here and reaches the engine with no other signature.

    `EngineCore.validate` returns a checked copy: `params.max_tokens` resolved against the
    context, `arrival_time` stamped if it was None, `lora_id` set to the content id of the
    `lora` adapter (and appended to `cache_extra`, so no KV is shared across adapters).
    Possibly handed to another thread (later another process): a plain value."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, where the caller had one
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival_time: float | None = None  # time.monotonic() of arrival; None: at validation
    cache_extra: CacheExtra = ()  # what changes the KV besides tokens (a cache salt, ...)
    session_id: str | None = None  # an agent's session: its blocks outlive it for a TTL
    lora: str | None = None  # a loaded LoRA adapter's name; None: the base model
    kv_handoff: KVHandoff | None = None  # a prefill/decode hand-off it takes part in
    lora_id: str | None = None  # set by validation: the adapter's content id
    grammar: GrammarSpec | None = None  # what the output must match (structured output)
    caller_id: str | None = None  # the caller's id for it (X-Request-Id: a Conductor's), for logs
    # Token ids the output is expected to follow, largely (OpenAI's Predicted Outputs: the file
    # an edit rewrites); speculative decoding drafts from it; the output is the same without it
    prediction: list[int] | None = None
