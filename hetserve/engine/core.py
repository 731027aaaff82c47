"""EngineCore: one step loop that reads top to bottom: schedule -> execute -> update."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field, replace

import torch

from hetserve.config import EngineConfig, MoEConfig
from hetserve.core.outputs import RequestOutput
from hetserve.core.request import Request, RequestStatus
from hetserve.core.sampling import SamplingParams
from hetserve.engine.detokenizer import IncrementalDetokenizer
from hetserve.engine.output import ParentState, SeqState
from hetserve.engine.runner import ModelRunner, SeqInput
from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.paged import PagedKVCache
from hetserve.layers.sampler import sample, token_logprobs
from hetserve.model.loader import load_model
from hetserve.model.tokenizer import Tokenizer
from hetserve.sched.scheduler import Scheduler, SchedulerOutput

CPU_KV_CAP_BYTES = 2 << 30
_SEEDS = random.Random()  # seeded from os.urandom once per process


def _fresh_seed() -> int:
    return _SEEDS.getrandbits(63)


log = logging.getLogger(__name__)


def _converted(model_dir) -> dict | None:
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("hetserve_experts") if path.is_file() else None


def _placement_rules(moe: MoEConfig, converted: dict | None):
    if moe.placement is None and converted is not None:
        # A converted model serves its experts on the CPU format it was converted to.
        from hetserve.moe.placement import default_rules

        rules = default_rules()
        backend = f"cpu-{converted['format']}"
        return [replace(r, backend=backend) if r.backend else r for r in rules]
    if moe.placement is None or moe.placement == "default":
        return moe.placement
    from hetserve.moe.placement import load_rules

    return load_rules(moe.placement)


def _build_hybrid(model, moe: MoEConfig, converted: dict | None) -> None:
    from hetserve.moe.hybrid import apply_dense_backends, build_expert_backends
    from hetserve.moe.routing_stats import RoutingStats

    stats = RoutingStats.load(moe.routing_stats) if moe.routing_stats else None
    options = {}
    if converted is not None and converted.get("group_size"):
        options["cpu-int4"] = {"group_size": converted["group_size"]}
    build_expert_backends(
        model, model.hybrid_plan, moe.gpu_experts, stats, moe.cpu_threads, backend_options=options
    )
    apply_dense_backends(model, model.hybrid_plan)
    log.info("placement:\n%s", model.hybrid_plan.table())


@dataclass
class EngineStats:
    prompt_tokens_computed: int = 0  # prompt (and recomputed) tokens actually run through the model
    generation_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        cfg = config or EngineConfig(**overrides)
        self.config = cfg
        if cfg.model is None:
            from hetserve.model.tiny import demo_model_dir

            model_dir = demo_model_dir()
        else:
            model_dir = cfg.model
        self.model_dir = str(model_dir)
        converted = _converted(model_dir)
        self.model = load_model(
            model_dir,
            device=cfg.device,
            dtype=cfg.dtype,
            placement=_placement_rules(cfg.moe, converted),
        )
        self.tokenizer = Tokenizer(model_dir)
        if self.model.hybrid_plan is not None:
            _build_hybrid(self.model, cfg.moe, converted)
        if cfg.moe.max_deferred_experts_per_token:
            self.model.set_expert_deferral(cfg.moe.max_deferred_experts_per_token)
        mcfg = self.model.config
        self.max_model_len = min(
            cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(mcfg.eos_token_ids)
        bs = cfg.cache.block_size
        num_blocks = self._num_blocks()
        self.runner = ModelRunner(self.model, num_blocks, bs)
        self.kv = KVCacheManager(
            num_blocks, bs, cfg.cache.enable_prefix_caching, cfg.cache.hash_seed.encode()
        )
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.max_model_len)
        self.seqs: dict[str, SeqState] = {}
        self.parents: dict[str, ParentState] = {}
        self.stats = EngineStats()

    def _num_blocks(self) -> int:
        cfg, bs = self.config, self.config.cache.block_size
        per_seq = math.ceil(self.max_model_len / bs)
        if cfg.cache.num_blocks is not None:
            n = cfg.cache.num_blocks
        else:
            per_block = PagedKVCache.bytes_per_block(
                self.model.kv_cache_spec(), bs, next(self.model.parameters()).dtype
            )
            budget = cfg.cache.kv_cache_bytes or CPU_KV_CAP_BYTES
            n = min(budget // per_block, per_seq * cfg.scheduler.max_num_seqs + 1)
        if n - 1 < per_seq:
            raise InvalidInputError(
                f"KV cache of {n} blocks cannot hold one {self.max_model_len}-token sequence; "
                "give more KV memory or a smaller --max-model-len"
            )
        return n

    # ---- requests -----------------------------------------------------------------------------
    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidInputError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                "(room for at least one generated token is needed); shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInputError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        cache_extra: tuple = (),
        stream: bool = True,
    ) -> None:
        """Queue a request. With stream=False, `step` returns its output only once finished."""
        if request_id in self.parents:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        parent = ParentState(request_id, prompt, list(prompt_token_ids), stream=stream)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[request_id] = parent
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                rid, list(prompt_token_ids), params, priority=priority, cache_extra=cache_extra
            )
            gen = torch.Generator(device="cpu")
            # Unseeded requests draw a fresh seed; torch.seed() would cost ~2 ms per request and
            # reseed the global generator as a side effect.
            gen.manual_seed(params.seed + i if params.seed is not None else _fresh_seed())
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output
            )
            state = SeqState(
                req, parent, i, detok, gen, [] if params.logprobs is not None else None
            )
            parent.seqs.append(state)
            self.seqs[rid] = state
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> bool:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return False
        for s in parent.seqs:
            self.scheduler.finish(s.request.request_id, RequestStatus.FINISHED_ABORTED)
            self.seqs.pop(s.request.request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    # ---- the step loop ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if not sched.scheduled:
            return []
        sampled = self._execute(sched)
        self.scheduler.update(sched, sampled, self.eos_ids)
        self.stats.steps += 1
        return self._process_outputs(sched, sampled)

    def _execute(self, sched: SchedulerOutput) -> dict[str, int]:
        inputs = []
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start : start + s.num_new_tokens]
            inputs.append(SeqInput(tokens, start, self.kv.block_ids(req.request_id)))
            prompt_left = max(0, min(req.num_prompt_tokens - start, s.num_new_tokens))
            self.stats.prompt_tokens_computed += prompt_left
        hidden = self.runner.forward(inputs)
        ends = torch.tensor([len(i.token_ids) for i in inputs]).cumsum(0) - 1
        self._prompt_logprobs(sched, hidden, ends)
        rows = [i for i, s in enumerate(sched.scheduled) if s.samples]
        if not rows:
            return {}
        logits = self.runner.logits(hidden[ends[rows].to(hidden.device)])
        states = [self.seqs[sched.scheduled[i].request.request_id] for i in rows]
        for r, st in enumerate(states):
            req = st.request
            if len(req.output_token_ids) < req.params.min_tokens:
                stop = set(req.params.stop_token_ids)
                stop |= set() if req.params.ignore_eos else self.eos_ids
                if stop:
                    logits[r, sorted(stop)] = float("-inf")
        tokens = sample(
            logits, [st.request.params for st in states], [st.generator for st in states]
        )
        need_lp = [r for r, st in enumerate(states) if st.logprobs is not None]
        if need_lp:
            lp = logits[need_lp].log_softmax(-1)
            for j, r in enumerate(need_lp):
                k = states[r].request.params.logprobs
                states[r].logprobs += token_logprobs(lp[j : j + 1], tokens[r : r + 1], k)
        self.stats.generation_tokens += len(rows)
        return {st.request.request_id: t for st, t in zip(states, tokens.tolist(), strict=True)}

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden, ends) -> None:
        for i, s in enumerate(sched.scheduled):
            st = self.seqs[s.request.request_id]
            parent = st.parent
            if parent.prompt_logprobs is None or st.index != 0:
                continue
            start = s.request.num_computed_tokens
            plen = len(parent.prompt_token_ids)
            # Positions p in this chunk whose next token p+1 is a prompt token not yet scored.
            first = max(start, len(parent.prompt_logprobs) - 1)
            last = min(start + s.num_new_tokens, plen - 1)
            if first >= last:
                continue
            row0 = int(ends[i]) - s.num_new_tokens + 1
            h = hidden[row0 + first - start : row0 + last - start]
            lp = self.runner.logits(h).log_softmax(-1)
            chosen = torch.tensor(parent.prompt_token_ids[first + 1 : last + 1], device=lp.device)
            parent.prompt_logprobs += token_logprobs(lp, chosen, s.request.params.prompt_logprobs)

    def _process_outputs(self, sched: SchedulerOutput, sampled: dict[str, int]):
        touched: dict[str, ParentState] = {}
        for s in sched.scheduled:
            st = self.seqs.get(s.request.request_id)
            if st is None or s.request.request_id not in sampled:
                continue
            req = st.request
            stop_str = st.detok.add(sampled[req.request_id])
            if stop_str is not None and not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if stop_str is not None:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if req.is_finished:
                st.finish_reason = req.status.value
                self.stats.finished[st.finish_reason] = (
                    self.stats.finished.get(st.finish_reason, 0) + 1
                )
                self.seqs.pop(req.request_id)
            touched[st.parent.request_id] = st.parent
        outputs = []
        for rid, parent in touched.items():
            if not parent.stream and not parent.finished:
                continue  # snapshots copy every token list: build only what someone reads
            out = parent.snapshot()
            if out.finished:
                self.parents.pop(rid, None)
            outputs.append(out)
        return outputs

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = {r.request_id for r in self.scheduler.running + self.scheduler.waiting}
        assert live == set(self.seqs), (live, set(self.seqs))
