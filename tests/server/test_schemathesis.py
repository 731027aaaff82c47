"""The server against its own OpenAPI spec, fuzzed by schemathesis: valid and invalid bodies,
no 5xx, every status, content type and JSON body as the spec documents it.

Bounded: a fixed number of examples per operation and mode (a few hundred requests in all,
in-process over ASGI), derandomized so CI sees the same cases every run. Hypothesis drives the
strategies directly (schemathesis' pytest plugin does not support this pytest).
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from schemathesis.generation import GenerationMode

from hetserve.config import EngineConfig, LoRAConfig
from hetserve.engine.async_llm import AsyncLLM
from hetserve.server.app import create_app

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
OPERATIONS = [  # (method, path, mode, examples): GETs take no input, so no negative cases
    ("POST", "/v1/completions", POSITIVE, 75),
    ("POST", "/v1/completions", NEGATIVE, 75),
    ("POST", "/v1/chat/completions", POSITIVE, 75),
    ("POST", "/v1/chat/completions", NEGATIVE, 75),
    ("POST", "/v1/load_lora_adapter", POSITIVE, 25),
    ("POST", "/v1/load_lora_adapter", NEGATIVE, 25),
    ("POST", "/v1/unload_lora_adapter", POSITIVE, 25),
    ("POST", "/v1/unload_lora_adapter", NEGATIVE, 25),
    ("GET", "/v1/models", POSITIVE, 5),
    ("GET", "/health", POSITIVE, 5),
    ("GET", "/metrics", POSITIVE, 5),
]


@pytest.fixture(scope="module")
def schema(tiny_model):
    # A short context keeps the longest generations a valid request can ask for short. LoRA
    # runtime updates on: the fuzzer's adapter paths are refused (400), its names unknown (404).
    config = EngineConfig(
        model=str(tiny_model("qwen3-moe", lm_head_scale=4.0)),
        max_model_len=64,
        lora=LoRAConfig(enable_lora=True),
    )
    engine = AsyncLLM(config)
    app = create_app(engine, "tiny", lora_runtime_updates=True)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    engine.shutdown()


@pytest.mark.parametrize("method,path,mode,examples", OPERATIONS, ids=str)
def test_server_conforms_to_its_spec(schema, method, path, mode, examples):
    operation = schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        case.call_and_validate(checks=CHECKS)

    run()
