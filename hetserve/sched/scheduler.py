"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

There are no prefill or decode modes: each running request is given
`min(tokens it still needs, budget left)` tokens per step, so prefill chunks and decodes share a
step. The budget is tokens (`max_num_batched_tokens`) and, in a step with decodes, time: a
prompt chunk gets the tokens the engine's step-time model predicts to fit in what the decodes
leave of the step's limit (`step_budget.py`), or a layer slice: a chunk that runs a few decoder
layers a step, its blocks allocated when it starts, its tokens computed after its last layer
(one a step, `Request.prefill_slice`). Running requests are served first, decodes
before prompt chunks, chunks in (priority, arrival) order; if their blocks cannot be
allocated, the lowest-priority running request (latest arrival under FCFS) is preempted: its
blocks are freed and it returns to the waiting queue to be recomputed, or, with a `Swapper`
(`--preemption-mode swap`), its blocks and linear-attention state are copied to host memory
first and copied back when it is admitted again, where it resumes. Waiting requests are
admitted only in steps without preemption, preempted ones first, then in (priority, arrival)
order.

With KV tiers (a `KVLoader`), a waiting request whose next blocks a store holds first waits for
them: the loader reserves device blocks and loads them while every other request keeps stepping;
once they land the request is admitted with them as prefix hits. How they are loaded is the
loader's business. A swapped-out request never asks the loader: its host copies hold every
token it had computed (a swap-out is all or nothing), so it resumes from them alone, without a
prefix lookup; a step may admit one request by swap-in and another with loaded blocks, but no
request needs both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetserve.config import SchedulerConfig, SchedulingPolicy
from hetserve.core.request import PrefillSlice, Request, RequestStatus
from hetserve.core.stats import EngineLoad
from hetserve.kv.block_pool import KVBlock
from hetserve.kv.loader import KVLoader, LoadState
from hetserve.kv.manager import KVCacheManager, cdiv
from hetserve.kv.swap import Swapper
from hetserve.sched.step_budget import StepBudget, StepTime, step_limit_s


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # a prompt chunk's time allowed by the step budget (None: a decode, or no allowance): the
    # engine sets the step's measured time against it in the request's prefill_debt_s
    allowance_s: float | None = None
    # A layer slice: the chunk runs decoder layers [a, b) in this step (None: all of them);
    # `completes`: b is the last layer, so the chunk's tokens are computed after this step.
    layers: tuple[int, int] | None = None
    completes: bool = True
    # Speculative decoding: the decode's drafts checked in this step (after its last token;
    # counted in num_new_tokens)
    drafts: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence end, so a next token is sampled."""
        end = self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens
        return end and self.completes


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        loader: KVLoader | None = None,
        step_time: StepTime | None = None,
        swapper: Swapper | None = None,
        slice_layers: int | None = None,
    ) -> None:
        self.cfg = cfg
        # Decoder layers a prompt chunk may run through over several steps beside decodes
        # (layer slices; None: chunks run every layer in their step).
        self.slice_layers = slice_layers
        self.slices_started = 0  # layer slices begun (each a chunk over several steps)
        self.swapper = swapper  # None: preemption by recompute
        self.kv = kv
        self.max_model_len = max_model_len
        self.loader = loader
        self.step_time = step_time  # None: chunks sized by tokens alone
        self.limit_s = step_limit_s(cfg.max_step_ms, cfg.slo_tbt_ms)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # waiting for their blocks to land
        self.requests: dict[str, Request] = {}

    def _key(self, req: Request) -> tuple[int, float]:
        prio = req.priority if self.cfg.policy is SchedulingPolicy.PRIORITY else 0
        return (prio, req.arrival_time)

    def _run_order(self, req: Request) -> tuple[bool, bool, int, float]:
        # Decodes first: a prompt chunk is sized by what they leave of the step; then a
        # chunk part way through the layers (it holds its blocks).
        prompt = req.num_tokens - req.num_computed_tokens > 1
        return (prompt, req.prefill_slice is None, *self._key(req))

    def _admit_order(self, req: Request) -> tuple[bool, int, float]:
        # Preempted requests resume before new ones: they were admitted once already.
        return (req.num_preemptions == 0, *self._key(req))

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.loader is not None:
            self._land_loads()
        chunked = self.cfg.enable_chunked_prefill
        model = self.step_time if chunked else None
        layers = self.slice_layers if chunked else None
        budget = StepBudget(model, self.limit_s, self.cfg.max_num_batched_tokens, layers)
        for req in sorted(self.running, key=self._run_order):
            if budget.tokens == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            computed = req.num_computed_tokens
            sl = req.prefill_slice
            if sl is not None:  # its blocks are allocated: it goes on where it stopped
                total, debt = req.num_tokens, req.prefill_debt_s
                k = budget.slice_layers(sl.tokens, computed, sl.layer, total, debt)
                out.scheduled.append(self._slice(req, sl.tokens, computed, sl.layer, k, budget))
                budget.take_slice(sl.tokens)
                continue
            if self._try_slice(req, computed, budget, out):
                continue
            n = budget.grant(req.num_tokens - computed, computed, req.prefill_debt_s)
            if n == 0:
                continue  # the step's time is spent: its chunk waits for the next one
            if not self._allocate_or_preempt(req, n, out):
                continue
            out.scheduled.append(self._scheduled(req, n, computed, budget))
            budget.take(n, computed)
        if not out.preempted:
            self._admit_waiting(out, budget)
        self._add_drafts(out, budget)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """Scheduled decodes take their drafts last, in run order, as many as the step's
        tokens, its time limit and the free blocks leave once every decode, prompt chunk and
        admission has what it gets: drafts never hold anything back or preempt anyone."""
        for s in out.scheduled:
            req = s.request
            if not req.spec_token_ids or s.num_new_tokens != 1 or s.layers is not None:
                continue
            computed = req.num_computed_tokens
            if computed != req.num_tokens - 1:
                continue  # a one-token prompt chunk, not a decode
            k = budget.drafts_fit(computed, min(len(req.spec_token_ids), budget.tokens))
            if k < 1 or self.kv.allocate_slots(req, 1 + k) is None:
                continue
            s.drafts = req.spec_token_ids[:k]
            s.num_new_tokens = 1 + k
            budget.take_drafts(computed, k)

    def _try_slice(
        self, req: Request, computed: int, budget: StepBudget, out: SchedulerOutput
    ) -> bool:
        """Start a layer slice of `req`'s prompt if the budget prefers one (its blocks
        allocated now, for the whole chunk); False: it gets an ordinary chunk, or none."""
        piece = budget.slice(req.num_tokens - computed, computed, req.prefill_debt_s)
        if piece is None:
            return False
        n, k = piece
        if not self._allocate_or_preempt(req, n, out):
            return True  # preempted itself: nothing runs for it
        self._start_slice(req, n, computed, k, budget, out)
        return True

    def _start_slice(
        self, req: Request, n: int, computed: int, k: int, budget: StepBudget, out: SchedulerOutput
    ) -> None:
        req.prefill_slice = PrefillSlice(n)
        self.slices_started += 1
        out.scheduled.append(self._slice(req, n, computed, 0, k, budget))
        budget.take_slice(n)

    def _slice(
        self, req: Request, n: int, computed: int, done: int, k: int, budget: StepBudget
    ) -> ScheduledRequest:
        """Layers [done, done + k) of a chunk of `n` after `computed`, with its allowance."""
        assert self.slice_layers is not None
        end = done + k
        allowance = budget.slice_allowance(n, computed, req.num_tokens, k)
        return ScheduledRequest(
            req, n, allowance, layers=(done, end), completes=end == self.slice_layers
        )

    @staticmethod
    def _scheduled(req: Request, n: int, computed: int, budget: StepBudget) -> ScheduledRequest:
        """`n` tokens of `req` after `computed`, a prompt chunk with its allowance."""
        if computed >= req.num_tokens - 1:
            return ScheduledRequest(req, n)  # a decode
        return ScheduledRequest(req, n, budget.allowance(n, computed, req.num_tokens))

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(req, n) is None:
            victim = max(self.running, key=self._key)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        rid = req.request_id
        states = self.kv.states
        slot = None if states is None else states.slot_id(rid)
        # The blocks of its computed tokens: not those allocated for a chunk still to run (a
        # layer slice's, or one scheduled earlier in this step), whose slots hold nothing yet
        # and which it may ask for in other sizes when it resumes.
        held = self.kv.block_ids(rid)[: cdiv(req.num_computed_tokens, self.kv.block_size)]
        swapped = (
            self.swapper is not None
            and req.num_computed_tokens > 0
            and self.swapper.swap_out(rid, held, slot)
        )
        self.kv.free(req)
        req.prefill_slice = None  # a chunk part way through the layers starts again
        req.spec_token_ids = []  # drafted again once it runs
        if not swapped:  # recomputed from its prompt (and whatever prefix is cached then)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.append(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _land_loads(self) -> None:
        assert self.loader is not None
        for req in self.loader.landed():
            del self.loading[req.request_id]
            if req.status is RequestStatus.WAITING_FOR_KV:
                req.status = RequestStatus.WAITING
                self.waiting.append(req)  # its (priority, arrival) puts it back in line
            else:  # finished (aborted) while loading: its blocks are released only now
                self.loader.release(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        self.waiting.sort(key=self._admit_order)
        i, cap = 0, self.cfg.max_num_seqs
        while i < len(self.waiting) and budget.tokens > 0 and len(self.running) < cap:
            req = self.waiting[i]
            swapped = self.swapper is not None and self.swapper.holds(req.request_id)
            computed: list[KVBlock] = []
            if swapped:  # it resumes from its own copies: no prefix lookup, no load
                num_cached = req.num_computed_tokens
            else:
                computed, num_cached = self.kv.get_computed_blocks(req)
            if self.loader is not None and not swapped:
                state = self.loader.prepare(req, computed)
                if state is LoadState.WAIT:
                    i += 1  # its store lookup is still out: the next ones need not wait
                    continue
                if state is LoadState.LOADING:
                    self.waiting.pop(i)
                    req.status = RequestStatus.WAITING_FOR_KV
                    self.loading[req.request_id] = req
                    continue
                if state is LoadState.READY:  # loaded right there: hits now
                    ready = self.loader.ready_prefix(req)
                    computed, num_cached = ready or self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_cached
            if n > budget.tokens and not self.cfg.enable_chunked_prefill:
                break
            piece = budget.slice(n, num_cached, req.prefill_debt_s)
            k = None
            if piece is not None:
                n, k = piece
            else:
                n = budget.grant(n, num_cached, req.prefill_debt_s)
            if n == 0:
                break  # the step's time is spent
            if swapped:
                if self.kv.allocate_slots(req, n) is None:
                    break
                self._swap_in(req)
            elif self.kv.allocate_slots(req, n, computed, num_cached) is None:
                if not self.running and self.loader is not None and self.loader.release_all():
                    continue  # held loads filled the pool: recompute rather than deadlock
                break
            if self.loader is not None:
                self.loader.release(req)  # its table holds the loaded blocks now
            self.waiting.pop(i)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
                self.kv.record_admission(req, num_cached // self.kv.block_size)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if k is not None:
                self._start_slice(req, n, num_cached, k, budget, out)
                continue
            out.scheduled.append(self._scheduled(req, n, num_cached, budget))
            budget.take(n, num_cached)

    def _swap_in(self, req: Request) -> None:
        assert self.swapper is not None
        rid = req.request_id
        slot = None if self.kv.states is None else self.kv.states.slot_id(rid)
        self.swapper.swap_in(rid, self.kv.block_ids(rid), slot)

    @staticmethod
    def charge(scheduled: list[ScheduledRequest], seconds: float) -> None:
        """The step that computed `scheduled` took `seconds`: each prompt chunk's request owes
        what its step took beyond the chunk's allowance (the step budget's ledger)."""
        for s in scheduled:
            if s.allowance_s is not None:
                debt = s.request.prefill_debt_s + seconds - s.allowance_s
                s.request.prefill_debt_s = max(debt, 0.0)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], eos_ids: set[int],
               ended: frozenset[str] | set[str] = frozenset(),
               accepted: dict[str, list[int]] | None = None) -> None:  # fmt: skip
        """Advance computed counts, append sampled tokens, finish what hit a token-level stop;
        `ended`: requests whose grammar is complete, finished whatever their stop rules say;
        `accepted`: a drafted decode's drafts that held, emitted before its sampled token."""
        accepted = accepted or {}
        for s in out.scheduled:
            req = s.request
            if s.layers is not None:
                sl = req.prefill_slice
                assert sl is not None
                if not s.completes:
                    sl.layer = s.layers[1]  # its tokens are computed once every layer ran
                    continue
                req.prefill_slice = None
            token = sampled.get(req.request_id)
            if s.drafts:
                self._update_drafted(req, s, token, accepted.get(req.request_id, []), eos_ids)
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed(req)
            if token is None:
                continue
            req.output_token_ids.append(token)
            status = self._check_stop(req, token, eos_ids)
            if status is None and req.request_id in ended:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.finish(req.request_id, status)

    def _update_drafted(
        self, req: Request, s: ScheduledRequest, token: int | None, accepted: list[int],
        eos_ids: set[int],
    ) -> None:  # fmt: skip
        """A drafted decode: its last token and the accepted drafts are computed (their KV
        holds); it emits them and the sampled token, up to the first token-level stop."""
        req.spec_token_ids = []
        emitted = [] if token is None else [*accepted, token]
        status = None
        for t in emitted:
            req.output_token_ids.append(t)
            status = self._check_stop(req, t, eos_ids)
            if status is not None:
                break
        computed = req.num_computed_tokens + s.num_new_tokens - len(s.drafts) + len(accepted)
        req.num_computed_tokens = min(computed, req.num_tokens)
        self.kv.cache_computed(req)
        if status is not None:
            self.finish(req.request_id, status)

    def _check_stop(self, req: Request, token: int, eos_ids: set[int]) -> RequestStatus | None:
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in eos_ids:
                return RequestStatus.FINISHED_STOPPED
        assert p.max_tokens is not None, "the engine resolves max_tokens at admission"
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is; frees its blocks. Unknown ids: None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.status = status
        req.prefill_slice = None
        if request_id in self.loading:
            return req  # the load still writes its blocks: they are freed when it lands
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            if self.loader is not None:
                self.loader.release(req)  # a load of its blocks landed while it waited
            if self.swapper is not None:
                self.swapper.drop(request_id)
        self.kv.free(req)
        return req

    def load(self) -> EngineLoad:
        """The queued and running work, what the Conductor balances instances by (EngineStats)."""
        pool = self.kv.pool
        waiting = [*self.waiting, *self.loading.values()]
        prefill = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        return EngineLoad(
            queued_prefill_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting)
            + sum(r.num_prompt_tokens - r.num_computed_tokens for r in prefill),
            queued_requests=len(waiting),
            running_decodes=len(decodes),
            decode_context_tokens=sum(r.num_tokens for r in decodes),
            free_blocks=pool.num_free,
            total_blocks=pool.num_usable,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert len(self.running) <= self.cfg.max_num_seqs
        ids = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        live_loads = {rid for rid, r in self.loading.items() if not r.is_finished}
        assert ids | live_loads == set(self.requests), (ids, live_loads, set(self.requests))
        assert not ids & set(self.loading)
        for r in self.loading.values():
            assert r.status is RequestStatus.WAITING_FOR_KV or r.is_finished
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert r.num_computed_tokens <= r.num_tokens
            assert len(self.kv.tables[r.request_id]) * self.kv.block_size >= r.num_computed_tokens
            sl = r.prefill_slice
            if sl is not None:
                assert self.slice_layers is not None and 0 < sl.layer < self.slice_layers
                assert sl.hidden is not None
                held = len(self.kv.tables[r.request_id]) * self.kv.block_size
                assert held >= r.num_computed_tokens + sl.tokens
        for r in self.waiting:
            assert r.request_id not in self.kv.tables
        if self.swapper is not None:
            swapped = self.swapper.swapped()
            assert swapped <= {r.request_id for r in self.waiting}, swapped
