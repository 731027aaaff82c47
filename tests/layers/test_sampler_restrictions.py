"""allowed_token_ids and bad words in the sampler, against brute force: which tokens may be
drawn after which output, with min_tokens' ban beside them."""

import itertools
import random

import pytest
import torch

from hetserve.core.sampling import SamplingParams
from hetserve.layers.sampler import SamplingRow, process_logits

V, EOS = 12, 11


def brute_force(params: SamplingParams, out: list[int]) -> set[int]:
    """The tokens that may come next, from the definitions."""
    ok = set(params.allowed_token_ids or range(V))
    for word in params.bad_words_token_ids:
        head = list(word[:-1])
        if not head or out[len(out) - len(head) :] == head and len(out) >= len(head):
            ok.discard(word[-1])
    if len(out) < params.min_tokens and ok - {EOS}:
        ok.discard(EOS)  # min_tokens' ban, unless it would leave nothing
    return ok


def drawable(params: SamplingParams, out: list[int]) -> set[int]:
    logits = torch.randn(1, V)
    row = SamplingRow(params, None, [1, 2], list(out))
    errors = process_logits(logits, [row], [EOS])
    assert not errors
    return {i for i in range(V) if torch.isfinite(logits[0, i])}


def test_every_mix_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        allowed = tuple(rng.sample(range(V), rng.randint(0, 5)))
        words = tuple(
            tuple(rng.randrange(V) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(0, 3))
        )
        never = {w[0] for w in words if len(w) == 1}
        if allowed and set(allowed) <= never:
            continue  # refused at construction (below)
        params = SamplingParams(allowed_token_ids=allowed, bad_words_token_ids=words,
                                min_tokens=rng.randint(0, 2), max_tokens=8)  # fmt: skip
        for n in range(3):
            for out in itertools.islice(itertools.product(range(V), repeat=n), 40):
                want = brute_force(params, list(out))
                if not want:
                    continue  # a bad word's tail closed the last allowed token: an error
                assert drawable(params, list(out)) == want, (params, out)


def test_nothing_left_fails_that_row_alone():
    blocked = SamplingParams(allowed_token_ids=(3,), bad_words_token_ids=((5, 3),))
    fine = SamplingParams()
    logits = torch.randn(2, V)
    rows = [SamplingRow(blocked, None, [1], [5]), SamplingRow(fine, None, [1], [5])]
    errors = process_logits(logits, rows, [EOS])
    assert list(errors) == [0] and "no token to sample" in str(errors[0])
    with pytest.raises(ValueError, match="ban every one"):
        SamplingParams(allowed_token_ids=(3, 4), bad_words_token_ids=((3,), (4,)))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


OPEN, CLOSE, FORCED = (3,), (4,), (9, 4, 9)


def _think(budget, prompt, out):
    from hetserve.layers.sampler import thinking_forced

    params = SamplingParams(thinking_budget=budget, think_open_ids=OPEN, think_close_ids=CLOSE,
                            think_forced_ids=FORCED)  # fmt: skip
    return thinking_forced(SamplingRow(params, None, prompt, out))


def test_a_thinking_budget_forces_its_end_once_spent():
    # Opened in the output: two free tokens, then the forced end token by token, then free.
    assert [_think(2, [1], out) for out in ([], [3], [3, 5], [3, 5, 6], [3, 5, 6, 9],
                                              [3, 5, 6, 9, 4], [3, 5, 6, 9, 4, 9])] == [
        None, None, None, 9, 4, 9, None]  # fmt: skip
    # Opened by the prompt (the template's), and budget 0: forced from the first token.
    assert [_think(0, [1, 3], out) for out in ([], [9], [9, 4, 9])] == [9, 4, None]
    assert _think(1, [1, 3, 7, 4], [5]) is None  # the prompt closed it: thinking off
    assert _think(1, [1], [5, 6]) is None  # never opened
    assert _think(3, [1], [3, 5, 4, 6, 7, 8]) is None  # it ended by itself in time
    assert _think(1, [1], [3, 5, 4, 3, 6]) == 9  # a second thinking: its own budget
    logits = torch.zeros(1, V)
    params = SamplingParams(thinking_budget=0, think_open_ids=OPEN, think_close_ids=CLOSE,
                            think_forced_ids=FORCED, allowed_token_ids=(1, 2))  # fmt: skip
    process_logits(logits, [SamplingRow(params, None, [3], [])], [EOS])
    assert [i for i in range(V) if torch.isfinite(logits[0, i])] == [9]  # forced wins
    with pytest.raises(ValueError, match="think_open_ids"):
        SamplingParams(thinking_budget=4)


def _naive_forced(budget, prompt, out):
    """The rule read from the whole output, by brute force (the sampler looks only where a
    thinking can still be forced)."""

    def after_last(seq, pat):
        hits = [i + len(pat) for i in range(len(seq) - len(pat) + 1)
                if tuple(seq[i : i + len(pat)]) == pat]  # fmt: skip
        return hits[-1] if hits else None

    start = after_last(out, OPEN)
    if start is None:
        tail = prompt[-64:]
        opened = after_last(tail, OPEN)
        if opened is None or (after_last(tail, CLOSE) or -1) >= opened:
            return None
        start = 0
    spent = start + budget
    if after_last(out[start:spent], CLOSE) is not None:
        return None
    written = len(out) - spent
    return FORCED[written] if 0 <= written < len(FORCED) else None


def test_the_thinking_rule_against_brute_force():
    rng = random.Random(1)
    for _ in range(3000):
        budget = rng.randint(0, 4)
        prompt = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 4))]
        out = [rng.choice([3, 4, 5, 6, 9]) for _ in range(rng.randint(0, 14))]
        assert _think(budget, prompt, out) == _naive_forced(budget, prompt, out), (
            budget, prompt, out)  # fmt: skip
