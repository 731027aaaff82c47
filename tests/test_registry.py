"""The one registry behind models, expert backends and store backends."""

import pytest

from hetserve.errors import InvalidInputError, UnsupportedArchitectureError
from hetserve.model.registry import MODELS, model_class
from hetserve.moe.experts import BACKENDS
from hetserve.registry import Registry
from hetserve.store.registry import STORES, open_store


def test_lazy_entries_load_on_first_use_and_unknown_names_list_the_known():
    reg: Registry[object] = Registry("widget", {"json": "json:dumps", "csv": "csv"})
    assert reg.names() == ["csv", "json"] and "json" in reg
    import json

    assert reg.get("json") is json.dumps
    with pytest.raises(InvalidInputError, match="unknown widget 'xml'; known: csv, json"):
        reg.get("xml")
    with pytest.raises(InvalidInputError):
        reg.get("csv")  # the module imported but registered nothing under that name

    @reg.register("mine")
    def mine():
        return 1

    assert reg.get("mine") is mine
    with pytest.raises(RuntimeError, match="registered twice"):
        reg.register("mine")(lambda: 2)


def test_the_three_registries():
    assert model_class("Qwen3MoeForCausalLM").__name__ == "Qwen3MoeForCausalLM"
    assert "GptOssForCausalLM" in MODELS.names()
    with pytest.raises(UnsupportedArchitectureError, match="BertModel"):
        model_class("BertModel")
    assert {"torch", "cpu-int8", "cpu-mxfp4", "cpu-fp8"} <= set(BACKENDS.names())
    assert callable(BACKENDS.get("cpu-fp32"))
    assert STORES.names() == ["local", "mooncake", "pool", "redis"]
    with open_store("local://?dram=1M") as store:
        assert type(store) is STORES.get("local")
