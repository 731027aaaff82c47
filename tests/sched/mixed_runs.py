"""What the chunking property tests share (test_time_chunking.py, test_layer_slices.py): the
streams and long prompts they draw, a run of them through an engine step by step, and each
output's reference from an engine that never chunks."""

from hypothesis import strategies as st

from hetserve import SamplingParams
from hetserve.core.request import NewRequest

# (prompt, max_tokens): short prompts that decode a while, long prompts that decode a little.
stream = st.tuples(
    st.lists(st.integers(1, 499), min_size=1, max_size=6).map(tuple), st.integers(2, 40)
)
long_prompt = st.tuples(
    st.lists(st.integers(1, 499), min_size=60, max_size=150).map(tuple), st.integers(1, 4)
)


def reference(unchunked, cache: dict, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of `prompt` from the engine that never chunks (cached)."""
    key = (prompt, max_tokens)
    if key not in cache:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = unchunked.generate(prompt_token_ids=list(prompt), sampling_params=params)
        cache[key] = out[0].token_ids
    return cache[key]


def run(eng, reqs, tag: str, max_steps: int = 3000) -> dict[str, list[int]]:
    """Submit each (prompt, max_tokens, at step) at its step, step until all finish (the
    scheduler's integrity checked after every step); request id -> its tokens."""
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(reqs))
    step = 0
    while pending or eng.has_unfinished():
        for i, (prompt, max_tokens, at) in list(pending):
            if at <= step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                eng.submit(NewRequest(f"{tag}{i}", list(prompt), params))
                pending.remove((i, reqs[i]))
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        eng.check_integrity()
        step += 1
        assert step < max_steps, "no progress"
    return finished
