"""EngineCore: one step loop that reads top to bottom: schedule -> execute -> update.

Who calls it: `LLM` (offline) and `AsyncLLM` (the server's engine thread); never two threads at
once. A `NewRequest` is checked by `validate` (which any thread may call: it reads only the
model's fixed facts) and queued by `enqueue` on the engine's thread (`submit` does both); `step`
returns the outputs it produced.

Failure contract: bad input is an `InvalidInputError` from `validate`, before anything is
queued. A request that fails inside a step is finished with an error output (its KV blocks
freed) while every other request goes on; see `StepExecutor`.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from hetserve import envs
from hetserve.config import EngineConfig, Role
from hetserve.core.outputs import RequestOutput
from hetserve.core.request import HandoffRole, NewRequest, Request, RequestStatus
from hetserve.core.stats import EngineStats
from hetserve.engine.detokenizer import IncrementalDetokenizer
from hetserve.engine.execute import StepExecutor, StepResult, describe
from hetserve.engine.handoff import Handoff
from hetserve.engine.kv_services import kv_facts, open_kv_services
from hetserve.engine.kv_store import kv_identity
from hetserve.engine.lora import build_lora_manager
from hetserve.engine.output import ParentState, SeqState
from hetserve.engine.runner import ModelRunner
from hetserve.engine.setup import context_length, graph_options, resolve_model_dir, state_slots
from hetserve.engine.speculative import open_drafter
from hetserve.engine.stats import engine_stats
from hetserve.engine.step_log import StepLog, shape_of
from hetserve.engine.step_probe import measure_steps, probe_cache_file, step_time_model
from hetserve.engine.swap import HostSwap
from hetserve.engine.validate import RequestValidator
from hetserve.errors import InvalidInputError
from hetserve.kv.cache_spec import paged_layout, state_slot_bytes
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.sizing import num_kv_blocks
from hetserve.kv.tier_policy import CostModel
from hetserve.kv.tiers import LOAD_POLL_S, TierManager
from hetserve.model.build import build_model, prefill_bf16
from hetserve.model.build import kv_dtype as build_kv_dtype
from hetserve.model.memory_facts import measured as measured_memory
from hetserve.model.tokenizer import Tokenizer
from hetserve.native.openmp import release_thread_team
from hetserve.sched.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from hetserve.structured import GrammarCompiler

if TYPE_CHECKING:
    from hetserve.disagg.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)

_SEEDS = random.Random()  # seeded from os.urandom once per process
_SEED_MASK = (1 << 64) - 1  # torch generators take 64-bit seeds; seed + i may overflow


class EngineCore:
    def __init__(self, config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        self.config = cfg
        self.model_dir = resolve_model_dir(cfg.model)
        self.model = build_model(cfg, self.model_dir)
        # the start-up line saying where the weights run (what `--placement auto` chose)
        self.placement_summary: str = self.model.placement_choice.line()
        self.tokenizer = Tokenizer(self.model_dir)
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        self.max_model_len = context_length(cfg.max_model_len, mcfg.max_position_embeddings)
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(mcfg.eos_token_ids)
        bs = cfg.cache.block_size
        specs = self.model.cache_specs()
        states = state_slots(cfg, specs)
        n_states = 0 if states is None else states.num_slots
        kv_dtype = build_kv_dtype(cfg, self.model)
        state_bytes = n_states * state_slot_bytes(specs)
        num_blocks = num_kv_blocks(
            cfg, self.max_model_len, paged_layout(specs), kv_dtype, state_bytes
        )
        self.lora = build_lora_manager(self.model, cfg.lora)  # None: no LoRA code runs at all
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
        self.validator = RequestValidator(
            self.vocab_size, self.max_model_len, self.lora, self.grammars
        )
        lora_batch = None if self.lora is None else self.lora.batch
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            bs,
            lora_batch,
            n_states,
            kv_dtype,
            graph_options(cfg, self.model, self.max_model_len),
        )
        self.runner.kv.bf16_prefill = prefill_bf16(cfg, self.model, kv_dtype)
        # where host memory went, once the KV cache exists (/metrics: hetserve_memory_bytes)
        self.memory = measured_memory(self.model, self.runner.kv.nbytes())
        log.info("%s", self.memory.line())
        seed = kv_identity(self.model_dir, self.runner.kv, cfg.cache.hash_seed, self.runner.state)
        self.kv = KVCacheManager(
            num_blocks, bs, cfg.cache.enable_prefix_caching, seed, cfg.cache.session_ttl_s, states
        )
        c = cfg.cache
        self.kv_events: KVEventPublisher | None = None  # bound before anything else starts
        if c.kv_events is not None:
            from hetserve.disagg.kv_publisher import open_publisher

            self.kv_events = open_publisher(
                self.kv, c.kv_events, c.kv_events_replay, c.kv_events_token
            )
        # One cost model, measured now and refined by every step: the scheduler sizes prompt
        # chunks with its step-time fit, the KV tiers weigh loads against recomputing with it.
        self.cost = CostModel(steps=step_time_model(self.model))
        probes = probe_cache_file(self.model_dir, self.runner, self.placement_summary)
        measure_steps(self.runner, self.kv, self.cost, self.max_model_len, probes)
        log.info("%s", self.cost.steps.describe())
        services = open_kv_services(cfg, self.kv, self.runner, self.cost, self.kv_events)
        self.tiers: TierManager | None = services.tiers
        self.kv_summary: str | None = services.kv_summary  # the start-up line of the KV tiers
        self.handoff = services.handoff
        self.swap: HostSwap | None = services.swap  # preemption by swap's host copies
        # Prompt chunks beside decodes may run a few decoder layers a step (not with LoRA
        # layers or linear-attention state, whose forwards carry per-batch state).
        sliceable = self.lora is None and self.runner.state is None
        slices = len(self.model.model.layers) if sliceable else None
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.max_model_len, services.loader,
                                   self.cost.steps, self.swap, slices)  # fmt: skip
        self.step_log = StepLog(self.cost, envs.step_trace())
        self.seqs: dict[str, SeqState] = {}
        self.parents: dict[str, ParentState] = {}
        self.executor = StepExecutor(self.runner, self.seqs, self.eos_ids, self.lora)
        self._counts = {"steps": 0, "preemptions": 0, "prompt_tokens": 0, "generation": 0,
                        "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted": 0}  # fmt: skip
        self.drafter = open_drafter(cfg.speculative, self.runner, self.kv, self.max_model_len)
        self._finished: dict[str, int] = {}
        self._kv_info = kv_facts(cfg, self.kv, kv_dtype, seed, self.tiers, self.kv_events)
        release_thread_team()  # the build's OpenMP team: whoever steps makes its own (openmp.py)

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, new: NewRequest) -> NewRequest:
        """Check `new` against the model and return its checked copy (see `NewRequest`).
        Thread-safe. Raises InvalidInputError naming the field; nothing is queued."""
        h = new.kv_handoff
        if h is not None:
            side = self.handoff.sender if h.role is HandoffRole.SEND else self.handoff.receiver
            if side is None:
                raise InvalidInputError(
                    f"this instance (role {self.config.disagg.role.value}) does not "
                    f"{h.role.value} KV hand-offs",
                    param="kv_handoff",
                )
        return self.validator.request(new)

    def enqueue(self, new: NewRequest, stream: bool = True) -> None:
        """Queue a checked request (from `validate`), on the engine's thread. With
        stream=False, `step` returns its output only once finished."""
        assert new.arrival_time is not None and new.params.max_tokens is not None, "unchecked"
        rid, params = new.request_id, new.params
        if rid in self.parents:
            raise InvalidInputError(f"request id {rid!r} is already in use", param="request_id")
        if new.lora_id is not None and not (self.lora and self.lora.has(new.lora_id)):
            raise InvalidInputError("its LoRA adapter was unloaded meanwhile", param="model")
        parent = ParentState(rid, new.prompt, new.prompt_token_ids, stream=stream)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[rid] = parent
        for i in range(params.n):
            sid = rid if params.n == 1 else f"{rid}#{i}"
            req = Request(
                sid,
                list(new.prompt_token_ids),
                params,
                arrival_time=new.arrival_time,
                priority=new.priority,
                cache_extra=new.cache_extra,
                session_id=new.session_id,
                lora_id=new.lora_id,
                kv_handoff=new.kv_handoff,
                prediction=new.prediction,
            )
            gen = torch.Generator(device="cpu")
            # Unseeded requests draw a fresh seed; torch.seed() would cost ~2 ms per request and
            # reseed the global generator as a side effect.
            seed = params.seed + i if params.seed is not None else _SEEDS.getrandbits(63)
            gen.manual_seed(seed & _SEED_MASK)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                new.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                frozenset(self.eos_ids) | frozenset(params.stop_token_ids),
            )
            state = SeqState(
                req, parent, i, detok, gen, [] if params.logprobs is not None else None
            )
            if new.grammar is not None:  # compiled at validation: a cache hit and a copy here
                state.grammar = self.grammars.matcher(new.grammar)
            parent.seqs.append(state)
            self.seqs[sid] = state
            self.scheduler.add_request(req)

    def submit(self, new: NewRequest, stream: bool = True) -> None:
        """Validate and enqueue (one thread doing both: `LLM`, tests)."""
        self.enqueue(self.validate(new), stream=stream)

    def abort_request(self, request_id: str) -> bool:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return False
        for s in parent.seqs:
            self.scheduler.finish(s.request.request_id, RequestStatus.FINISHED_ABORTED)
            self.seqs.pop(s.request.request_id, None)
            if self.tiers is not None:
                self.tiers.forget(s.request)
        self._finished["abort"] = self._finished.get("abort", 0) + 1
        return True

    def background_work(self) -> bool:
        """KV saves or hand-offs are out: a step (even with nothing to schedule) takes them
        in."""
        sending = self.handoff.sender is not None and self.handoff.sender.busy()
        return sending or (self.tiers is not None and self.tiers.saver.pending() > 0)

    def has_unfinished(self) -> bool:
        # Loads of aborted requests still hold blocks: keep stepping until they land.
        return bool(self.parents) or bool(self.scheduler.loading)

    # ---- the step loop ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()  # a step is what a stream waits between tokens: all of it
        self.kv.pool.set_time(time.monotonic())
        if self.lora is not None and self.lora.retired:  # unloaded adapters no one uses now
            self.lora.collect({st.request.lora_id for st in self.seqs.values()})
        if self.tiers is not None:  # a load planned now waits through the running requests' steps
            self.tiers.expect(self.scheduler.running, self.config.scheduler.max_num_batched_tokens)
        if self.drafter is not None:
            self.drafter.draft(self.scheduler.running, self._has_grammar)
        sched = self.scheduler.schedule()
        if self.tiers is not None:
            self.tiers.capture_evicted()  # before this step's forward writes over them
        self._counts["preemptions"] += len(sched.preempted)
        if self.handoff.sender is not None:
            self.handoff.sender.pump()
        if not sched.scheduled:
            if self.tiers is not None:
                self.tiers.after_step()
            if self.scheduler.loading or self.scheduler.waiting or self.background_work():
                time.sleep(LOAD_POLL_S)  # only loads or hand-offs are out: wait, not spin
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            st = self.seqs.get(s.request.request_id)
            if st is not None and st.parent.scheduled_time is None:
                st.parent.scheduled_time = now
        # before update advances the requests; a layer slice is timed apart (observe_slices)
        shape = shape_of([s for s in sched.scheduled if s.layers is None])
        states = self.kv.state_input if self.kv.states is not None else None
        t_batch = time.perf_counter()
        result = self.executor.run(sched.scheduled, self.kv.block_ids, states)
        batch_s = time.perf_counter() - t_batch
        self.scheduler.charge(sched.scheduled, batch_s)
        self.step_log.observe_slices(sched.scheduled, result)  # before update advances them
        if self.handoff.sender is not None:
            self._send_handoffs(sched.scheduled, result)
        outputs = self._fail(result.failed)
        ok = [s for s in sched.scheduled if s.request.request_id in self.seqs]
        done = SchedulerOutput(ok, sched.preempted)
        before = [(s.request, len(s.request.output_token_ids)) for s in ok]
        self.scheduler.update(done, result.sampled, self.eos_ids, result.ended, result.accepted)
        # what each sequence emitted (drafted decodes: up to the first token-level stop)
        emitted = {r.request_id: r.output_token_ids[n:] for r, n in before}
        self._commit(result, emitted)
        if self.drafter is not None:
            self.drafter.observe(result.drafted, result.accepted)
        if self.tiers is not None:
            self.tiers.after_step()
        outputs += self._process_outputs(ok, emitted)
        # after stop strings took back what a drafted decode emitted past them
        self._counts["generation"] += sum(len(r.output_token_ids) - n for r, n in before)
        self.step_log.observe(sched.scheduled, shape, time.perf_counter() - t0, batch_s, result)
        return outputs

    def _send_handoffs(self, scheduled: list[ScheduledRequest], result: StepResult) -> None:
        """Requests that hand their KV off and computed their whole prompt in this step: ship
        it now, before finishing frees their blocks."""
        for s in scheduled:
            req = s.request
            h = req.kv_handoff
            if h is None or h.role is not HandoffRole.SEND or req.output_token_ids:
                continue
            if s.samples and req.request_id not in result.failed:
                self.handoff.sender.send(req)  # type: ignore[union-attr]

    def _commit(self, result: StepResult, emitted: dict[str, list[int]]) -> None:
        c = self._counts
        c["steps"] += 1
        c["prompt_tokens"] += result.prompt_tokens
        drafted = {sid: n for sid, n in result.drafted.items() if sid not in result.failed}
        c["spec_drafts"] += len(drafted)
        c["spec_draft_tokens"] += sum(drafted.values())
        c["spec_accepted"] += sum(len(result.accepted.get(sid, ())) for sid in drafted)
        for sid, n in drafted.items():
            st = self.seqs.get(sid)
            if st is not None:
                st.request.num_draft_tokens += n
                st.request.num_accepted_tokens += len(result.accepted.get(sid, ()))
        for sid, entry in result.logprobs.items():
            st = self.seqs.get(sid)
            if st is not None and st.logprobs is not None:
                entries = [*result.accepted_logprobs.get(sid, ()), entry]
                st.logprobs += entries[: len(emitted.get(sid, ()))]
        for pid, entries in result.prompt_logprobs.items():
            parent = self.parents.get(pid)
            if parent is not None:
                parent.prompt_logprobs += entries

    def _fail(self, failed: dict[str, str]) -> list[RequestOutput]:
        """Finish the requests (all sequences of each) that own the failed sequences."""
        outputs = []
        for sid, message in failed.items():
            st = self.seqs.get(sid)
            if st is None or st.parent.request_id not in self.parents:
                continue
            parent = self.parents.pop(st.parent.request_id)
            for s in parent.seqs:
                self.scheduler.finish(s.request.request_id, RequestStatus.FINISHED_ERROR)
                self.seqs.pop(s.request.request_id, None)
                if s.finish_reason is None:
                    s.finish_reason = RequestStatus.FINISHED_ERROR.value
            self._finished["error"] = self._finished.get("error", 0) + 1
            outputs.append(parent.snapshot(error=message))
        return outputs

    def _process_outputs(
        self, scheduled: list[ScheduledRequest], emitted: dict[str, list[int]]
    ) -> list[RequestOutput]:
        touched: dict[str, ParentState] = {}
        failed: dict[str, str] = {}
        for s in scheduled:
            sid = s.request.request_id
            st = self.seqs.get(sid)
            if st is None or not emitted.get(sid):
                continue
            try:
                self._advance_text(st, emitted[sid])
            except Exception as exc:  # this request's detokenization: fail it alone
                log.exception("request %s failed while detokenizing", sid)
                failed[sid] = describe(exc)
                continue
            touched[st.parent.request_id] = st.parent
        outputs = self._fail(failed)
        for rid, parent in touched.items():
            if rid not in self.parents or (not parent.stream and not parent.finished):
                continue  # snapshots copy every token list: build only what someone reads
            out = parent.snapshot()
            if out.finished:
                self.parents.pop(rid, None)
            outputs.append(out)
        return outputs

    def _has_grammar(self, sid: str) -> bool:
        st = self.seqs.get(sid)
        return st is None or st.grammar is not None

    def _advance_text(self, st: SeqState, tokens: list[int]) -> None:
        """The step's tokens of one sequence (the last of its output); a stop string ends it
        there, and tokens a drafted decode emitted after it are taken back."""
        req = st.request
        for i, token in enumerate(tokens):
            stop_str = st.detok.add(token)
            if stop_str is None:
                continue
            if not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            after = len(tokens) - i - 1
            if after:
                del req.output_token_ids[-after:]
                if st.logprobs:  # _commit gave each emitted token its entry
                    del st.logprobs[-after:]
            break
        if req.is_finished:
            st.finish_reason = req.status.value
            self._finished[st.finish_reason] = self._finished.get(st.finish_reason, 0) + 1
            self.seqs.pop(req.request_id)

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        handoff = None if self.config.disagg.role is Role.BOTH else self.handoff
        return engine_stats(self.scheduler, self.kv, self._counts, self._finished, self.tiers,
                            handoff, self.step_log)  # fmt: skip

    def reset_prefix_cache(self) -> int:
        """Drop the device prefix cache (free blocks only); KV tiers keep what they saved.
        Returns the blocks dropped. Benchmarks use it to measure warm-from-tier TTFT. A
        linear-attention model's free state checkpoints go too (the tiers keep theirs)."""
        if self.kv.states is not None:
            self.kv.states.pool.drop_cached()
        return self.kv.pool.drop_cached()

    def routing_stats(self):
        """The routing statistics being recorded (MoEConfig.record_routing_stats), else None."""
        return self.model.routing_stats

    def kv_info(self) -> dict[str, object]:
        """How this engine names and publishes its KV (fixed at start; any thread): a Conductor
        hashes prompts with `block_size` and `hash_seed` (the root of every chained block
        hash) as this engine does, and follows its KV events at `kv_events` (None: off)."""
        return dict(self._kv_info)

    def close(self) -> None:
        """Save the KV the store does not have yet (bounded) and close it; the KV events say
        the instance holds nothing and stop."""
        self.handoff.close()
        self.handoff = Handoff()
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self.kv_events is not None:
            self.kv_events.close()

    def check_integrity(self) -> None:
        sched = self.scheduler
        sched.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity({r.request_id for r in sched.waiting}, set(sched.loading))
        if self.lora is not None:
            self.lora.check_integrity()
        live = {r.request_id for r in sched.running + sched.waiting}
        live |= {rid for rid, r in sched.loading.items() if not r.is_finished}
        assert live == set(self.seqs), (live, set(self.seqs))
