"""LLM: offline, batched generation through the EngineCore."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from hetserve.config import EngineConfig
from hetserve.core.beam_search import BeamSearchOutput, BeamSearchParams, likeliest, search
from hetserve.core.lora import LoRARequest
from hetserve.core.outputs import RequestOutput
from hetserve.core.request import NewRequest
from hetserve.core.sampling import SamplingParams
from hetserve.core.stats import EngineStats
from hetserve.engine.core import EngineCore
from hetserve.engine.errors import EngineRequestError
from hetserve.errors import InvalidInputError

T = TypeVar("T")
LoRASpec = LoRARequest | str | None  # an adapter to load or a loaded one's name; None = base
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's


class LLM:
    """`LLM(config)` with an EngineConfig, or `LLM(model_dir, **options)` with the options of
    `hetserve.config.ENGINE_OPTIONS` as keywords (device, dtype, max_model_len, block_size,
    num_kv_blocks, enable_prefix_caching, max_num_seqs, placement, cpu_threads, ...), which
    builds the EngineConfig. No model: the embedded demo model.

    LoRA as in vLLM: `LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)`, then
    `generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))` (loaded on first use);
    or adapters named up front, `LLM(model, lora_modules={"sql": "/adapters/sql"})`, and
    `lora_request="sql"`. A list gives each prompt its own adapter (None: the base model); they
    run in one batch.

    One LLM may be used from several threads: their calls take turns (the EngineCore under it
    is stepped by one thread at a time)."""

    def __init__(self, model: str | Path | EngineConfig | None = None, **options) -> None:
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError("give an EngineConfig or keyword options, not both")
            config = model
        else:
            config = EngineConfig.from_options(
                model=None if model is None else str(model), **options
            )
        self.config = config
        self.engine = EngineCore(config)
        self.model_dir = self.engine.model_dir
        self.model = self.engine.model
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()
        self._lock = threading.Lock()  # EngineCore: one thread at a time (engine/core.py)

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRASpec | list[LoRASpec] = None,
        predictions: list[str | list[int] | None] | None = None,
    ) -> list[RequestOutput]:
        """`predictions`: per prompt, text (or token ids) its output is expected to largely
        repeat (OpenAI's Predicted Outputs), or None; with `speculative_config` drafts follow
        it. The outputs are the same with or without."""
        with self._lock:
            requests = self._normalize(prompts, prompt_token_ids)
            if sampling_params is None or isinstance(sampling_params, SamplingParams):
                params = [sampling_params or SamplingParams()] * len(requests)
            else:
                many = isinstance(sampling_params, list | tuple)
                bad = [p for p in (sampling_params if many else [sampling_params])
                       if not isinstance(p, SamplingParams)]  # fmt: skip
                if bad:
                    raise TypeError(
                        "sampling_params takes a SamplingParams or a list of them, got "
                        f"{type(bad[0]).__name__}"
                    )
                params = list(sampling_params)
                if len(params) != len(requests):
                    raise InvalidInputError("sampling_params list must match the number of prompts")
            params = [self._spelled(p) for p in params]
            loras = self._lora_names(lora_request, len(requests))
            predicted = self._predictions(predictions, len(requests))
            # Everything is validated before anything is queued: one bad prompt queues nothing.
            new = [
                self.engine.validate(NewRequest(f"llm-{next(self._ids)}", ids, p, text, lora=lora,
                                                prediction=pred))  # fmt: skip
                for (text, ids), p, lora, pred in zip(requests, params, loras, predicted,
                                                      strict=True)  # fmt: skip
            ]
            for req in new:
                self.engine.enqueue(req, stream=False)
            return self._run([r.request_id for r in new], use_tqdm)

    def _predictions(self, given, n: int) -> list[list[int] | None]:
        if given is None:
            return [None] * n
        if not isinstance(given, list | tuple) or len(given) != n:
            raise InvalidInputError("predictions must be a list with one entry per prompt")
        out: list[list[int] | None] = []
        for g in given:
            if isinstance(g, str):
                g = self.tokenizer.encode(g, add_special_tokens=False)
            elif g is not None and not (isinstance(g, list | tuple)
                                        and all(isinstance(t, int) for t in g)):  # fmt: skip
                raise InvalidInputError("each prediction is a text, a list of token ids or None")
            out.append(None if g is None else list(g))
        return out

    def _spelled(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` as the token sequences the sampler bans (the tokenizer's spellings)."""
        if not params.bad_words:
            return params
        ids = self.tokenizer.bad_word_ids(params.bad_words)
        return replace(params, bad_words_token_ids=(*params.bad_words_token_ids, *ids))

    def _lora_names(self, spec, n: int) -> list[str | None]:
        """Adapter names per prompt; a LoRARequest with a path is loaded (or reloaded, if its
        name is bound to another path) first."""
        specs = list(spec) if isinstance(spec, list | tuple) else [spec] * n
        if len(specs) != n:
            raise InvalidInputError("lora_request list must match the number of prompts")
        names = []
        for s in specs:
            if isinstance(s, LoRARequest):
                if s.lora_path is not None:
                    self._ensure_lora(s.lora_name, s.lora_path)
                s = s.lora_name
            if s is not None and not isinstance(s, str):
                raise InvalidInputError("lora_request takes a LoRARequest, a name or None")
            names.append(s)
        return names

    def _ensure_lora(self, name: str, path: str) -> None:
        lora = self.engine.lora
        if lora is None:
            raise InvalidInputError(
                "this LLM has no LoRA support; create it with enable_lora=True (or lora_modules)"
            )
        loaded = lora.adapters().get(name)
        if loaded is None or Path(loaded).resolve() != Path(path).resolve():
            lora.load(name, path, replace=True)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", disable=not use_tqdm) as bar:
            while len(done) < len(order):
                for out in self.engine.step():
                    if out.error is not None:
                        for rid in order:
                            self.engine.abort_request(rid)
                        raise EngineRequestError(out.request_id, out.error)
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in order]

    def stats(self) -> EngineStats:
        """The engine's counters and state (KV usage, prefix hits, tokens computed, ...)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Drop the device prefix cache (the KV tiers keep their copies)."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    @property
    def placement_summary(self) -> str:
        """One line on where the weights run (the preset `--placement auto` chose, and why)."""
        return self.engine.placement_summary

    @property
    def memory(self):
        """Where host memory went at start-up (core/memory.py's MemoryUse)."""
        return self.engine.memory

    @property
    def kv_summary(self) -> str | None:
        """One line on the KV tiers behind the prefix cache (None without a KV store)."""
        return self.engine.kv_summary

    def flush_kv_store(self, timeout_s: float = 10.0, cold: bool = False) -> bool:
        """Save every cached block the KV store lacks and wait for the saves (at most
        `timeout_s`); `cold` then makes the next reads come from the medium, not a page cache
        (benchmarks of a tier). Returns whether all was saved; False without a KV store."""
        tiers = self.engine.tiers
        if tiers is None:
            return False
        with self._lock:
            done = tiers.flush(timeout_s)
            if cold:
                tiers.make_cold()
        return done

    def close(self) -> None:
        """Save the KV a KV store lacks yet, and close the store (no-op without one)."""
        with self._lock:
            self.engine.close()

    def routing_stats(self):
        """Routing statistics recorded so far (with record_routing_stats=True), else None."""
        return self.engine.routing_stats()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRASpec | list[LoRASpec] = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Each conversation rendered by the model's chat template and generated from.
        `continue_final_message` (with `add_generation_prompt=False`): the reply continues the
        last message (an assistant turn you began) instead of a new turn, as vLLM's."""
        if continue_final_message and add_generation_prompt:
            raise InvalidInputError(
                "continue_final_message continues the last message, add_generation_prompt "
                "opens a new turn: pass add_generation_prompt=False"
            )
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        for conversation in conversations:
            _check_messages(conversation)
        prompts = [
            self.tokenizer.apply_chat_template(
                c,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            for c in conversations
        ]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(
            sampling_params=sampling_params, prompt_token_ids=ids, lora_request=lora_request
        )
        for out, text in zip(outputs, prompts, strict=True):
            out.prompt = text
        return outputs

    def beam_search(
        self,
        prompts: str | list[str] | None = None,
        params: BeamSearchParams | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        lora_request: LoRASpec = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (core/beam_search.py): per prompt, `params.beam_width` beams,
        best first, each with its tokens (prompt and output), summed logprob, finish reason
        and output text. Each step is one batched `generate` of one token per beam."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError("params takes a BeamSearchParams(beam_width=..., max_tokens=...)")
        requests = self._normalize(prompts, prompt_token_ids)
        stops = frozenset(self.engine.eos_ids)
        step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=2 * params.beam_width)  # fmt: skip

        async def expand(beams: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
            outs = self.generate(sampling_params=step, prompt_token_ids=beams,
                                 lora_request=lora_request)  # fmt: skip
            return [likeliest(o.outputs[0].logprobs, k) for o in outs]

        results = []
        for _, ids in requests:
            steps = min(params.max_tokens, self.max_model_len - len(ids))  # the context's room
            if steps < 1:
                raise InvalidInputError(
                    f"prompt ({len(ids)} tokens) leaves no room for output in the model's "
                    f"context of {self.max_model_len} tokens; shorten it"
                )
            beams = _run(search(expand, ids, params.beam_width, steps, stops, params.ignore_eos,
                                params.length_penalty))  # fmt: skip
            for b in beams:
                b.text = self.tokenizer.decode(b.tokens[len(ids) :], skip_special_tokens=True)
            results.append(BeamSearchOutput(beams))
        return results

    def _normalize(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompt_token_ids is not None:
            if prompts is not None:
                raise InvalidInputError("give prompts or prompt_token_ids, not both")
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            if not isinstance(prompt_token_ids, list | tuple) or not all(
                isinstance(ids, list | tuple) for ids in prompt_token_ids
            ):
                raise TypeError(
                    "prompt_token_ids takes a list of token ids or a list of such lists"
                )
            return [(None, list(ids)) for ids in prompt_token_ids]
        if prompts is None:
            raise InvalidInputError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple) or not all(isinstance(p, str) for p in prompts):
            raise TypeError(
                "prompts takes a string or a list of strings; token ids go in prompt_token_ids"
            )
        return [(p, self.tokenizer.encode(p)) for p in prompts]


def _run(work: Coroutine[Any, Any, T]) -> T:
    """`work` to its end from synchronous code, also where an event loop already runs in this
    thread (a notebook, an async caller): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


def _check_messages(messages: object) -> None:
    """A conversation as OpenAI's messages: a chat template silently drops a message whose role
    it does not know, and renders a string as no message at all."""
    if not isinstance(messages, list | tuple) or not messages:
        raise TypeError(
            'messages takes a non-empty list of {"role": ..., "content": ...} dicts '
            "(or a list of such lists)"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with role and content, got {m!r:.40}")
        if m.get("role") not in CHAT_ROLES:
            raise InvalidInputError(
                f"messages[{i}]: role {m.get('role')!r} is not one of {', '.join(CHAT_ROLES)}",
                "role",
            )
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise InvalidInputError(
                f"messages[{i}]: a {m['role']} message needs content", "content"
            )
