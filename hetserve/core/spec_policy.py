"""How many drafts a sequence's next step should check (speculative decoding's draft length).

Who calls it: the engine's `Drafter` (engine/speculative.py), once a step per drafting
sequence, with that sequence's record of drafts checked and held and the engine's measured cost
of a step that checks k drafts (over a plain decode step). Pure: no I/O, no clock; nothing
raises for counts >= 0 and costs >= 1.

Why: on a GPU a decode step reads every weight whatever its few tokens, so checking drafts costs
little; on a CPU running a mixture of experts each drafted token reads the experts it routes to,
and a step that checks 4 drafts cost 3.4x a decode step on the 1.7 B MoE (bench speculative).
Drafts that hold with probability a each until the first miss give 1 + a + ... + a^k tokens for
cost(k): the length that maximises tokens per unit of step time, 0 (plain decoding) where no
length pays. The acceptance is the sequence's own, over its recent drafts (older ones weigh
less), from a prior of PRIOR_CHECKS drafts at PRIOR_RATE. A sequence that stopped drafting
tries again (`try_length` drafts) after FIRST_BACKOFF steps, a back-off that doubles each time
a try fails and ends when one holds (then it tries every step until a length pays), so it
comes back when its output starts to repeat its context, at a bounded cost.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_RATE = 0.7  # assumed acceptance before a sequence's own drafts are seen
PRIOR_CHECKS = 2.0  # the prior's weight, in drafts
DECAY = 0.9  # per draft checked: older drafts weigh this much less each
FIRST_BACKOFF = 8  # steps without drafts before trying again, doubled after each failed try
MAX_BACKOFF = 64  # a sequence whose output starts to copy is found within this many steps


def tokens_per_step(a: float, k: int) -> float:
    """Expected tokens a step emits checking k drafts that each hold with probability a (until
    the first miss; then the model's own token): 1 + a + ... + a^k."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_length(a: float, costs: list[float]) -> int:
    """The k in [0, len(costs) - 1] with the most tokens per unit of step time, costs[k] being
    a step with k drafts over a decode step (costs[0] == 1); the shortest among equals."""
    best, rate = 0, 1.0 / costs[0]
    for k in range(1, len(costs)):
        r = tokens_per_step(a, k) / costs[k]
        if r > rate * (1 + 1e-9):
            best, rate = k, r
    return best


def try_length(costs: list[float]) -> int:
    """The fewest drafts that pay if they all hold (k + 1 tokens for more than cost(k)): what a
    try after a back-off checks; 0 where no length would pay."""
    return next((k for k in range(1, len(costs)) if k + 1 > costs[k] * (1 + 1e-9)), 0)


@dataclass
class DraftRecord:
    """One sequence's drafting so far (the Drafter keeps one per running sequence)."""

    held: float = PRIOR_RATE * PRIOR_CHECKS  # decayed drafts that held
    checked: float = PRIOR_CHECKS  # decayed drafts tried (held, or the first miss)
    idle: int = 0  # steps without drafts since the last try
    backoff: int = FIRST_BACKOFF  # steps without drafts before the next try
    trying: bool = False  # its last drafts were a try after a back-off

    @property
    def rate(self) -> float:
        return self.held / self.checked

    def observe(self, checked: int, held: int) -> None:
        """A step checked `checked` drafts of which the first `held` held. The drafts after
        the first miss were never tried (the model's own token replaced them): the trials are
        the held ones and that miss."""
        trials = held + (1 if held < checked else 0)
        for j in range(trials):
            self.held = self.held * DECAY + (1.0 if j < held else 0.0)
            self.checked = self.checked * DECAY + 1.0
        if not checked:
            return
        if held:  # drafts that hold: after a try, another the next step
            self.backoff = 1
        elif self.trying:  # a failed try: wait twice as long as before the next
            self.backoff = min(max(2 * self.backoff, FIRST_BACKOFF), MAX_BACKOFF)
        else:
            self.backoff = FIRST_BACKOFF
        self.trying = False

    def length(self, costs: list[float], available: int) -> int:
        """Drafts to ask the proposer for next step, at most `available` (the room its
        max_tokens and the context leave): the best length for its acceptance, else a try once
        its back-off has passed (counted in steps), else 0."""
        trial = try_length(costs)
        if available < 1 or trial == 0:
            return 0  # no room, or no drafts could pay even if every one held
        k = best_length(self.rate, costs)
        if k > 0:
            self.trying = False
            return min(k, available)
        self.idle += 1
        if self.idle < self.backoff:
            return 0
        self.idle, self.trying = 0, True
        return min(trial, available)
