from hetserve.core.block_hash import hash_block_tokens, hash_prefix_blocks


def test_chain_depends_on_parent_tokens_and_extra():
    a = hash_prefix_blocks(list(range(64)), 16)
    assert len(a) == 4 and len(set(a)) == 4
    assert hash_prefix_blocks(list(range(64)), 16) == a
    b = hash_prefix_blocks(list(range(64)), 16, extra=("lora-1",))
    assert not set(a) & set(b)
    changed_first = hash_prefix_blocks([99] + list(range(1, 64)), 16)
    assert all(x != y for x, y in zip(a, changed_first, strict=True))  # chain propagates
    assert hash_prefix_blocks(list(range(70)), 16) == a  # partial tail block ignored


def test_seed_changes_root():
    assert hash_block_tokens(None, [1, 2], seed=b"x") != hash_block_tokens(None, [1, 2])
