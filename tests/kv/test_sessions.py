"""Agent sessions: a session's freed blocks are evicted last until their TTL passes."""

from hetserve import LLM, SamplingParams
from hetserve.core.block_hash import hash_block_tokens
from hetserve.core.request import NewRequest
from hetserve.kv.block_pool import BlockPool


def cached(pool: BlockPool, n: int, tag: int):
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.cache(b, hash_block_tokens(None, [tag, i]))
    return blocks


def test_protected_blocks_go_last_until_their_time_passes():
    pool = BlockPool(9)  # 8 usable
    pool.set_time(100.0)
    session = cached(pool, 3, tag=1)
    other = cached(pool, 3, tag=2)
    pool.free(session, protect_until=160.0)
    pool.free(other)
    pool.check_integrity()
    assert pool.num_free == 8
    got = pool.allocate(5)  # 2 never-used + 3 of `other`: the session's stay
    assert all(b.block_hash is None for b in got) and not set(got) & set(session)
    assert all(pool.lookup(hash_block_tokens(None, [1, i])) for i in range(3))
    pool.touch([session[0]])  # a prefix hit revives a protected block
    pool.free([session[0]], protect_until=160.0)
    last = pool.allocate(1)  # nothing else is free: the first to expire goes
    assert last[0] in session
    pool.free(got + last)
    pool.set_time(161.0)  # expired: plain free blocks, next in line
    assert pool.allocate(1)[0] in session
    pool.check_integrity()


def test_session_turn_finds_its_prefix_after_others_churned_the_pool(tiny_model):
    path = tiny_model("qwen3", lm_head_scale=4.0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    history = list(range(10, 74))  # 4 blocks of 16

    def run(session: str | None) -> int:
        llm = LLM(path, num_kv_blocks=14, max_model_len=96, block_size=16, session_ttl=600)
        llm.engine.submit(NewRequest("turn1", history, params, session_id=session))
        while llm.engine.has_unfinished():
            llm.engine.step()
        for i in range(3):  # other users' prompts fill (and evict from) the pool
            other = [100 + 30 * i + j for j in range(80)]
            llm.generate(prompt_token_ids=other, sampling_params=params)
        llm.engine.submit(NewRequest("turn2", history + [5, 6, 7], params, session_id=session))
        outs = []
        while llm.engine.has_unfinished():
            outs += llm.engine.step()
        llm.engine.check_integrity()
        return outs[-1].num_cached_tokens

    assert run(session=None) == 0
    assert run(session="agent-7") == 64
