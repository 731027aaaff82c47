"""Prompt-lookup drafts (core/ngram.py) against a brute-force search on small cases."""

import random

from hetserve.core.ngram import align, propose


def brute(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest n in [n_min, n_max] whose suffix occurred earlier with a token after it;
    the tokens after its latest such occurrence."""
    for n in range(n_max, n_min - 1, -1):
        if n < 1 or n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            at = starts[-1] + n
            return tokens[at : at + k]
    return []


def test_equals_brute_force_on_random_sequences():
    rng = random.Random(0)
    checked = matched = 0
    for _ in range(3000):
        vocab = rng.randint(1, 6)  # small alphabets: many matches, overlapping ones too
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        k, n_min = rng.randint(0, 6), rng.randint(1, 4)
        n_max = rng.randint(n_min - 1, 6)
        want = brute(tokens, k, n_min, n_max)
        assert propose(tokens, k, n_min, n_max) == want, (tokens, k, n_min, n_max)
        checked += 1
        matched += bool(want)
    assert matched > checked // 3  # the cases exercise matches, not just misses


def test_longest_match_wins_then_latest():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 9, 7, 2, 8, 3, 1, 2]
    # suffix [1, 2] occurred at 1 (then 9); suffix [2] latest at 5 (then 8): the longer wins
    assert propose(tokens, 3, 1, 3) == [9, 7, 2]
    assert propose(tokens, 3, 1, 1) == [8, 3, 1]
    assert propose(tokens, 3, 3, 4) == []  # [9, 1, 2] / [8, 3, 1, 2] never occurred before


def test_a_loop_drafts_its_continuation():
    tokens = [4, 7, 7, 3] + [1, 2, 3] * 4
    assert propose(tokens, 5, 2, 4) == [1, 2, 3]  # the latest occurrence ends 3 before the end
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 4, 2, 4) == [3, 1, 2]


def test_degenerate_inputs_draft_nothing():
    assert propose([], 4, 1, 4) == []
    assert propose([3], 4, 1, 4) == []
    assert propose([3, 3], 0, 1, 4) == []
    assert propose([3, 3], 4, 1, 4) == [3]


def brute_align(reference, tokens, start, n_min, n_max):
    if n_min < 1:
        return None
    for n in range(n_max, n_min - 1, -1):
        if n < 1 or n > len(tokens) or n > len(reference):
            continue
        suffix = tokens[len(tokens) - n :]
        ends = [i + n for i in range(len(reference) - n + 1) if reference[i : i + n] == suffix]
        if ends:
            ahead = [e for e in ends if e >= start]
            return ahead[0] if ahead else ends[-1]
    return None


def test_align_equals_brute_force_on_random_sequences():
    rng = random.Random(1)
    found = 0
    for _ in range(3000):
        vocab = rng.randint(1, 6)
        reference = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        start = rng.randint(0, len(reference) + 1)
        n_min = rng.randint(0, 4)
        n_max = rng.randint(n_min - 1, 6)
        want = brute_align(reference, tokens, start, n_min, n_max)
        assert align(reference, tokens, start, n_min, n_max) == want, (
            reference, tokens, start, n_min, n_max)  # fmt: skip
        found += want is not None
    assert found > 600  # the cases exercise matches, not just misses


def test_align_prefers_the_longest_match_then_the_first_ahead():
    #            0  1  2  3  4  5  6  7  8  9
    reference = [1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    assert align(reference, [5, 1, 2], 0, 1, 4) == 2  # [1, 2] first ends at 2
    assert align(reference, [5, 1, 2], 3, 1, 4) == 6  # ... at or after the cursor: 6
    assert align(reference, [5, 1, 2], 11, 1, 4) == 10  # none ahead: the last behind
    assert align(reference, [9, 1, 2], 7, 1, 4) == 6  # [9, 1, 2] only once: longest wins
    assert align(reference, [8, 8], 0, 1, 4) is None
