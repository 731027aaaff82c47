"""StateSlots: which state slot each request of a linear-attention model uses, and the prefix
checkpoints of those states.

Who calls it: the KV manager (`kv/manager.py`), beside its block tables; the executor reads
`inputs()` to tell the runner which slot a sequence continues, which checkpoint it resumes from
and where to take checkpoints. Pure policy: no torch, no clock; the bytes live in
`kv/state.py`'s `StateCache`, indexed by the slot ids handed out here.

One pool (a `BlockPool`, so the same ref counts, LRU and identities as KV blocks) serves both
uses of a slot:
  * a working slot per running request: the state its next forward continues;
  * a checkpoint: the state after the first k * `every` blocks of some sequence, registered
    under that block's chained hash, so a later request whose prefix has the same blocks
    resumes from it (SGLang's Mamba radix cache and vLLM's hybrid prefix caching do the same).
    A free checkpoint stays findable until the pool hands its slot out again (LRU).
A checkpoint is taken by the forward that computes its block's last token (a slot is set aside
when the step is planned, only while slots for `num_working` requests stay free) and registered
by `commit` once that forward is done. A request resuming from one holds it until its first
forward has copied it.

With KV tiers (`kv/state_tiers.py`) a waiting request whose prefix a store holds gets the
checkpoint at its end held for it (`hold`: one still in the pool; `reserve_load`: a slot a
store read fills, registered by `land_load`) until its admission resumes from it or it leaves
(`release_load`).

Failure: nothing raises on user input; `admit` returns False when no slot is free (the
scheduler then waits or preempts, as for blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hetserve.core.block_hash import BlockHash
from hetserve.kv.block_pool import BlockPool, KVBlock

StateInput = tuple[int | None, int | None, tuple[tuple[int, int], ...]]


class StateSlots:
    def __init__(self, num_working: int, num_checkpoints: int = 0, every: int = 4) -> None:
        if every < 1:
            raise ValueError(f"a state checkpoint every {every} blocks: must be >= 1")
        self.pool = BlockPool(num_working + num_checkpoints + 1)
        self.num_working = num_working
        self.every = every  # a checkpoint at the end of every `every`-th block
        self.working: dict[str, KVBlock] = {}
        self.resumes: dict[str, KVBlock] = {}  # to copy into the working slot, then released
        # Checkpoints the next forward takes: (index of the block they end, slot).
        self.saves: dict[str, list[tuple[int, KVBlock]]] = {}
        self.loads: dict[str, KVBlock] = {}  # checkpoints the KV tiers hold for waiting requests
        self.orphans: list[KVBlock] = []  # slots a load that timed out may still write
        # P/D hand-off, prefill side: the state after all of a prompt but its last token (what
        # the decode instance continues from), taken by the forward that reaches it.
        self.handoffs: dict[str, tuple[int, KVBlock]] = {}  # request -> (tokens, slot)
        self.shipping: dict[str, KVBlock] = {}  # taken by the hand-off sender until shipped
        # Told of each checkpoint the moment it is registered (the KV tiers' write-through).
        self.on_cached: list[Callable[[KVBlock], None]] = []

    @property
    def num_slots(self) -> int:
        return len(self.pool.blocks)

    def slot_id(self, request_id: str) -> int | None:
        slot = self.working.get(request_id)
        return None if slot is None else slot.block_id

    def resumable(self, hashes: Sequence[BlockHash], hit_blocks: int) -> int:
        """Of `hit_blocks` leading blocks found in the KV cache, how many a request can skip:
        the most that end at a checkpoint (0: none does)."""
        j = hit_blocks - hit_blocks % self.every
        while j > 0 and self.pool.lookup(hashes[j - 1]) is None:
            j -= self.every
        return j

    def admit(self, request_id: str, resume: BlockHash | None) -> bool:
        """A working slot for the request (once), resuming from the checkpoint under `resume`
        (found by `resumable` just before), or from the state a P/D hand-off landed for it.
        False, changing nothing, when no slot is free."""
        if request_id in self.working:
            return True
        handed = self.loads.get(request_id)
        if handed is not None and handed.block_hash is None:  # a hand-off's state, not a
            if self.pool.num_free < 1:  # checkpoint: it resumes from that, whatever `resume`
                return False
            self.resumes[request_id] = self.loads.pop(request_id)
            self.working[request_id] = self.pool.allocate(1)[0]
            return True
        ckpt = None if resume is None else self.pool.lookup(resume)
        assert resume is None or ckpt is not None, "a checkpoint vanished since its lookup"
        reviving = int(ckpt is not None and ckpt.ref_cnt == 0)
        if self.pool.num_free - reviving < 1:
            return False
        if ckpt is not None:
            self.pool.touch([ckpt])  # first: the allocation below must not evict it
            self.resumes[request_id] = ckpt
        self.working[request_id] = self.pool.allocate(1)[0]
        return True

    def plan_saves(
        self, request_id: str, start: int, num_new: int, hashes: Sequence[BlockHash], bs: int
    ) -> None:
        """Set slots aside for the checkpoints whose block ends within tokens
        [start, start + num_new) of this step (`hashes` covers them), skipping those already
        kept, while slots for every working request stay free."""
        # Deepest first: with few slots free, the checkpoint nearest the end of what is computed
        # serves the most (the next turn of this conversation); earlier ones age out first.
        for i in reversed(range(start // bs, (start + num_new) // bs)):
            if (i + 1) % self.every or self.pool.lookup(hashes[i]) is not None:
                continue
            if self.pool.num_free <= self.num_working - len(self.working):
                return
            self.saves.setdefault(request_id, []).append((i, self.pool.allocate(1)[0]))

    def plan_handoff(self, request_id: str, start: int, num_new: int, at: int) -> None:
        """A prompt handed off after `at` tokens: where the step of tokens [start, start +
        num_new) passes that point, set a slot aside for the state there (none free: the
        hand-off goes without it and the decode instance recomputes)."""
        if request_id in self.handoffs or not start <= at < start + num_new or not self._room():
            return
        self.handoffs[request_id] = (at, self.pool.allocate(1)[0])

    def take_handoff(self, request_id: str) -> int | None:
        """After the forward that took it: the hand-off state's slot, held until `shipped`."""
        taken = self.handoffs.pop(request_id, None)
        if taken is None:
            return None
        self.shipping[request_id] = taken[1]
        return taken[1].block_id

    def shipped(self, request_id: str) -> None:
        slot = self.shipping.pop(request_id, None)
        if slot is not None:
            self.pool.free([slot], evict_first=True)

    def inputs(self, request_id: str, start: int, bs: int) -> StateInput:
        """(working slot, checkpoint to resume from, checkpoints to take as (tokens into this
        step, slot)) of a request whose step starts at token `start`."""
        resume = self.resumes.get(request_id)
        saves = tuple(((i + 1) * bs - start, s.block_id) for i, s in self.saves.get(request_id, ()))
        handoff = self.handoffs.get(request_id)
        if handoff is not None and handoff[0] >= start:
            saves += ((handoff[0] - start, handoff[1].block_id),)
        return self.slot_id(request_id), None if resume is None else resume.block_id, saves

    def commit(
        self, request_id: str, num_computed: int, hashes: Sequence[BlockHash], bs: int
    ) -> None:
        """After a forward: the resumed checkpoint is released, the checkpoints it took are
        registered under their blocks' hashes (a free slot keeps its identity until reused)."""
        ckpt = self.resumes.pop(request_id, None)
        if ckpt is not None:
            self.pool.free([ckpt])
        pending = self.saves.pop(request_id, [])
        for i, slot in pending:
            if (i + 1) * bs <= num_computed:
                self.pool.cache(slot, hashes[i])
                if slot.block_hash is not None:
                    for fn in self.on_cached:
                        fn(slot)
        self.pool.free([slot for _, slot in reversed(pending)])

    def release(self, request_id: str) -> None:
        """A finished or preempted request gives back everything it held."""
        held = [b for b in (self.resumes.pop(request_id, None),) if b is not None]
        held += [slot for _, slot in reversed(self.saves.pop(request_id, []))]
        handoff = self.handoffs.pop(request_id, None)
        if handoff is not None:
            held.append(handoff[1])
        slot = self.working.pop(request_id, None)
        if slot is not None:
            held.append(slot)
        self.pool.free(held)

    # ---- checkpoints the KV tiers bring back -------------------------------------------
    def _room(self) -> bool:
        return self.pool.num_free > self.num_working - len(self.working)

    def hold(self, request_id: str, h: BlockHash) -> bool:
        """Hold the checkpoint under `h` (in the pool) for a waiting request; False: not there
        or the request holds one already."""
        ckpt = self.pool.lookup(h)
        if ckpt is None or request_id in self.loads:
            return False
        self.pool.touch([ckpt])
        self.loads[request_id] = ckpt
        return True

    def reserve_load(self, request_id: str) -> int | None:
        """A slot for a waiting request's checkpoint to be read into, while slots for every
        working request stay free; None: no room, or it holds one already."""
        if request_id in self.loads or not self._room():
            return None
        slot = self.pool.allocate(1)[0]
        self.loads[request_id] = slot
        return slot.block_id

    def land_load(self, request_id: str, h: BlockHash | None) -> None:
        """The read into the reserved slot is done: registered under `h` and still held for
        the request (None: it failed, the slot goes back). First writer wins: a copy of a
        checkpoint registered meanwhile goes back too."""
        slot = self.loads[request_id]
        if h is not None and slot.block_hash is None:
            self.pool.cache(slot, h)
        if slot.block_hash is None:
            del self.loads[request_id]
            self.pool.free([slot], evict_first=True)

    def release_load(self, request_id: str) -> None:
        slot = self.loads.pop(request_id, None)
        if slot is not None:
            self.pool.free([slot])

    def abandon_load(self, request_id: str, slot_id: int | None) -> None:
        """A load that timed out may still write into its slot: keep the slot held (no
        identity) until `end_abandoned`; the request no longer holds it."""
        slot = self.loads.pop(request_id, None)
        if slot is None:
            return
        if slot.block_id == slot_id:
            self.orphans.append(slot)
        else:  # a checkpoint held in place, nothing reads into it
            self.pool.free([slot])

    def end_abandoned(self, slot_id: int | None) -> None:
        for i, slot in enumerate(self.orphans):
            if slot.block_id == slot_id:
                del self.orphans[i]
                self.pool.free([slot], evict_first=True)
                return

    def release_all_loads(self) -> int:
        held = list(self.loads)
        for rid in held:
            self.release_load(rid)
        return len(held)

    def held(self) -> Iterable[KVBlock]:
        yield from self.loads.values()
        yield from self.orphans
        yield from self.shipping.values()
        yield from (slot for _, slot in self.handoffs.values())
        yield from self.working.values()
        yield from self.resumes.values()
        for pending in self.saves.values():
            yield from (slot for _, slot in pending)

    def check_integrity(self, live: Iterable[str]) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for b in self.held():
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), b
        owners = set(self.working) | set(self.resumes) | set(self.saves) | set(self.handoffs)
        assert owners <= set(live), "state slots held for a request without a table"
        assert set(self.resumes) <= set(self.working) and set(self.saves) <= set(self.working)
