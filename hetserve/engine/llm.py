"""LLM: offline generation. Prompts run one after another here; the batched engine replaces the
loop without changing this API."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from hetserve.core.outputs import CompletionOutput, RequestOutput
from hetserve.core.sampling import SamplingParams
from hetserve.engine.detokenizer import IncrementalDetokenizer
from hetserve.engine.runner import ModelRunner, SeqInput
from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.layers.sampler import sample, token_logprobs
from hetserve.model.loader import load_model
from hetserve.model.tokenizer import Tokenizer

BLOCK_SIZE = 16


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
    ) -> None:
        if model is None:
            from hetserve.model.tiny import demo_model_dir

            model = demo_model_dir()
        self.model_dir = Path(model)
        self.model = load_model(self.model_dir, device=device, dtype=dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        cfg = self.model.config
        limit = cfg.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        num_blocks = math.ceil(self.max_model_len / BLOCK_SIZE)
        self.runner = ModelRunner(self.model, num_blocks, BLOCK_SIZE)
        self._slots = torch.arange(num_blocks * BLOCK_SIZE, device=self.runner.device)
        self._ids = itertools.count()

    # ---- public API -------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        requests = self._normalize(prompts, prompt_token_ids)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(requests)
        else:
            params = list(sampling_params)
            if len(params) != len(requests):
                raise InvalidInputError("sampling_params list must match the number of prompts")
        for _, ids in requests:
            self.validate_prompt(ids)
        return [
            self._generate_one(str(next(self._ids)), text, ids, p)
            for (text, ids), p in zip(requests, params, strict=True)
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(sampling_params=sampling_params, prompt_token_ids=ids)
        for out, text in zip(outputs, prompts, strict=True):
            out.prompt = text
        return outputs

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidInputError("the prompt is empty; give at least one token")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; "
                "shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInputError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    # ---- internals --------------------------------------------------------------------------
    def _normalize(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompt_token_ids is not None:
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            return [(None, list(ids)) for ids in prompt_token_ids]
        if prompts is None:
            raise InvalidInputError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        return [(p, self.tokenizer.encode(p)) for p in prompts]

    @torch.inference_mode()
    def _generate_one(
        self, request_id: str, text: str | None, ids: list[int], params: SamplingParams
    ) -> RequestOutput:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        out = RequestOutput(request_id, text, ids, [], finished=True)
        for index in range(params.n):
            completion, prompt_lps = self._run_sequence(ids, params, gen, index)
            out.outputs.append(completion)
            if index == 0:
                out.prompt_logprobs = prompt_lps
        return out

    def _run_sequence(self, ids, params, gen, index):
        prompt_lps = None
        hidden = self.runner.forward([SeqInput(ids, 0, self._slots[: len(ids)])])
        if params.prompt_logprobs is not None:
            lp = self.runner.logits(hidden[:-1]).log_softmax(-1)
            chosen = torch.tensor(ids[1:], device=lp.device)
            prompt_lps = [None, *token_logprobs(lp, chosen, params.prompt_logprobs)]
        logits = self.runner.logits(hidden[-1:])
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.include_stop_str_in_output
        )
        comp = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        while True:
            if len(comp.token_ids) < params.min_tokens and stop_ids:
                logits[:, sorted(stop_ids)] = float("-inf")
            token = sample(logits, [params], [gen])
            if params.logprobs is not None:
                comp.logprobs += token_logprobs(logits.log_softmax(-1), token, params.logprobs)
            tid = int(token[0])
            comp.token_ids.append(tid)
            stop_str = detok.add(tid)
            if self._finish(comp, params, tid, stop_str, stop_ids, len(ids)):
                break
            n = len(ids) + len(comp.token_ids)
            hidden = self.runner.forward([SeqInput([tid], n - 1, self._slots[:n])])
            logits = self.runner.logits(hidden)
        comp.text = detok.visible_text(finished=True)
        return comp, prompt_lps

    def _finish(self, comp, params, tid, stop_str, stop_ids, prompt_len) -> bool:
        if stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
        elif tid in stop_ids and len(comp.token_ids) > params.min_tokens - 1:
            comp.finish_reason = "stop"
            comp.stop_reason = tid if tid in params.stop_token_ids else None
        elif len(comp.token_ids) >= params.max_tokens:
            comp.finish_reason = "length"
        elif prompt_len + len(comp.token_ids) >= self.max_model_len:
            comp.finish_reason = "length"
        return comp.finish_reason is not None
