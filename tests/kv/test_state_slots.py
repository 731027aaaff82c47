"""StateSlots on its own: working slots and prefix checkpoints sharing one pool."""

from hetserve.core.block_hash import hash_block_tokens
from hetserve.kv.state_slots import StateSlots

BS = 4


def hashes(n: int, salt: int = 0) -> list:
    out, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [salt, i, 0, 0], (), b"")
        out.append(parent)
    return out


def test_checkpoints_are_taken_deepest_first_and_resumed():
    slots = StateSlots(num_working=2, num_checkpoints=2, every=2)
    hs = hashes(8)
    assert slots.admit("a", None)
    slots.plan_saves("a", 0, 8 * BS, hs, BS)  # four boundaries, two spare slots (one kept free)
    _, _, saves = slots.inputs("a", 0, BS)
    assert [n for n, _ in saves] == [32, 24]  # the deepest, in tokens into the step
    slots.commit("a", 8 * BS, hs, BS)
    slots.check_integrity(["a"])
    assert slots.resumable(hs, 8) == 8 and slots.resumable(hs, 7) == 6
    assert slots.resumable(hs, 5) == 0  # blocks 2 and 4 kept no checkpoint
    slots.release("a")
    assert slots.admit("b", hs[5])  # resumes from the checkpoint after 6 blocks
    slot, resume, _ = slots.inputs("b", 6 * BS, BS)
    assert resume is not None and resume != slot
    slots.check_integrity(["b"])
    slots.commit("b", 6 * BS + 1, hs, BS)
    assert slots.inputs("b", 6 * BS + 1, BS)[1] is None  # copied once, then released
    slots.check_integrity(["b"])


def test_new_checkpoints_evict_the_oldest_shallowest_first():
    slots = StateSlots(num_working=1, num_checkpoints=2, every=1)
    ha, hb = hashes(3, salt=1), hashes(1, salt=2)
    assert slots.admit("a", None)
    slots.plan_saves("a", 0, 3 * BS, ha, BS)  # room for two of three: blocks 3 and 2
    slots.commit("a", 3 * BS, ha, BS)
    slots.release("a")
    assert slots.resumable(ha, 3) == 3 and slots.resumable(ha, 2) == 2
    assert slots.admit("b", None)  # its working slot takes the shallowest checkpoint's
    assert slots.resumable(ha, 3) == 3 and slots.resumable(ha, 2) == 0
    slots.plan_saves("b", 0, BS, hb, BS)
    slots.commit("b", BS, hb, BS)
    assert slots.resumable(ha, 3) == 0 and slots.resumable(hb, 1) == 1
    slots.check_integrity(["b"])


def test_admission_waits_for_a_slot():
    slots = StateSlots(num_working=1)
    assert slots.admit("a", None) and slots.admit("a", None)  # once per request
    assert not slots.admit("b", None)
    assert set(slots.working) == {"a"}
    slots.release("a")
    assert slots.admit("b", None)
    slots.check_integrity(["b"])
