"""One request value: every field of a `NewRequest` reaches the engine's scheduler unchanged,
whichever door it comes through (AsyncLLM.submit, AsyncLLM.generate, EngineCore.submit), and
validation fills in only what it promises (max_tokens, arrival time, the LoRA id)."""

import asyncio
import dataclasses

import pytest

from hetserve import SamplingParams
from hetserve.config import EngineConfig
from hetserve.core.request import NewRequest, Request
from hetserve.engine.async_llm import AsyncLLM
from hetserve.engine.core import EngineCore

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
FULL = NewRequest(
    "full",
    [5, 6, 7, 8],
    PARAMS,
    prompt="some text",
    priority=3,
    arrival_time=12.5,
    cache_extra=("salt:x",),
    session_id="agent-1",
)


@pytest.fixture(scope="module")
def core(tiny_model):
    return EngineCore(EngineConfig(model=str(tiny_model("qwen3")), max_model_len=64))


def _capture(core: EngineCore, monkeypatch) -> list[Request]:
    seen: list[Request] = []
    add = core.scheduler.add_request
    monkeypatch.setattr(core.scheduler, "add_request", lambda r: (seen.append(r), add(r))[1])
    return seen


def _check(req: Request) -> None:
    assert req.prompt_token_ids == FULL.prompt_token_ids
    assert req.priority == FULL.priority
    assert req.arrival_time == FULL.arrival_time
    assert req.cache_extra == FULL.cache_extra
    assert req.session_id == FULL.session_id
    assert req.params.max_tokens == PARAMS.max_tokens


def _drain(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def test_engine_submit_carries_every_field(core, monkeypatch):
    seen = _capture(core, monkeypatch)
    core.submit(FULL)
    _drain(core)
    assert len(seen) == 1
    _check(seen[0])


@pytest.mark.parametrize("door", ["submit", "generate"])
def test_async_doors_carry_every_field(core, monkeypatch, door):
    seen = _capture(core, monkeypatch)
    llm = AsyncLLM(engine=core)

    async def go():
        new = dataclasses.replace(FULL, request_id=f"async-{door}")
        stream = llm.submit(new) if door == "submit" else llm.generate(new)
        return [out async for out in stream]

    try:
        outs = asyncio.run(go())
    finally:
        llm.shutdown()
    assert outs[-1].finished
    assert len(seen) == 1
    _check(seen[0])


def test_validation_fills_only_what_it_promises(core):
    bare = NewRequest("bare", [1, 2, 3], SamplingParams(temperature=0, max_tokens=None))
    checked = core.validate(bare)
    assert checked.params.max_tokens == core.max_model_len - 3  # resolved against the context
    assert checked.arrival_time is not None  # stamped
    assert checked.lora_id is None and checked.cache_extra == ()
    unchanged = ("request_id", "prompt_token_ids", "prompt", "priority", "session_id", "lora")
    for name in unchanged:
        assert getattr(checked, name) == getattr(bare, name), name
    assert bare.arrival_time is None  # the caller's value is frozen, never touched
