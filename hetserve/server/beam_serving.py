"""vLLM's beam search served (`use_beam_search` on /v1/completions and /v1/chat/completions).

Who calls it: server/completions.py and server/chat.py, which turn the beams into choices.
The search is core/beam_search.py's; this gives it the engine: each step queues one greedy
one-token request per live beam with the `2 x width` likeliest next tokens, and gives their
blocks back in a finally (a client that leaves stops the search). Failure contract: the
checks of the sampling path (priority, truncation, the context's room) as 400s; the engine's
errors propagate.
"""

from __future__ import annotations

import itertools

from fastapi import Request

from hetserve.core.beam_search import Beam, likeliest, search
from hetserve.core.block_hash import salt_extra
from hetserve.core.request import NewRequest
from hetserve.core.sampling import SamplingParams
from hetserve.errors import PromptTooLongError
from hetserve.server.serving import OpenAIServing, arrival_time, caller_id
from hetserve.server.stream_merge import merge


async def search_beams(
    serving: OpenAIServing, req, ids: list[int], base: str, request: Request
) -> tuple[list[int], list[Beam]]:
    """The prompt as searched (truncated as asked) and `req.n` beams from it, best first."""
    engine = serving.engine
    serving.check_priority(req)
    ids = serving.kept(req, ids)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise PromptTooLongError(
            f"prompt ({len(ids)} tokens) leaves no room for output in the model's context "
            f"of {engine.max_model_len} tokens; shorten it"
        )
    serving.check_room(req, len(ids))
    stops = frozenset(engine.engine.eos_ids) | frozenset(req.stop_token_ids or ())
    limit, _ = req.output_limit()
    steps = itertools.count()
    # The same for every step's requests.
    arrived, lora, caller = arrival_time(request), serving.lora_of(req), caller_id(request)
    extra = salt_extra(req.cache_salt)

    async def expand(beams: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        step = next(steps)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)
        streams = []
        try:
            for i, tokens in enumerate(beams):
                new = NewRequest(f"{base}-{step}-{i}", tokens, params, priority=req.priority,
                                 arrival_time=arrived, session_id=req.session_id, lora=lora,
                                 caller_id=caller, cache_extra=extra)  # fmt: skip
                streams.append(engine.submit(new))
            finals = {i: out async for i, out in merge(streams)}
        finally:
            for st in streams:
                st.abort()  # a no-op once finished; frees a cancelled step's blocks
        return [likeliest(finals[i].outputs[0].logprobs, k) for i in range(len(beams))]

    return ids, await search(expand, ids, req.n, limit or room, stops, req.ignore_eos,
                             req.length_penalty)  # fmt: skip
