"""Datasets and templates: formats, column/tag mappings, labels only on assistant tokens."""

import json

from hetserve.finetune.data import load_examples
from hetserve.finetune.template import IGNORE, ChatFormat, encode_example
from hetserve.model.tokenizer import Tokenizer


def label_text(tok, ids, labels):
    return tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE], False)


def test_sharegpt_multi_turn_trains_on_every_assistant_turn(tiny_model, data_dir):
    tok = Tokenizer(tiny_model("qwen3-moe"))
    (ex,) = load_examples(["tiny_chat"], data_dir)
    assert ex.system == "be brief" and [m["role"] for m in ex.messages] == ["user", "assistant"] * 2
    ids, labels = encode_example(ChatFormat(tok), ex, 1024)
    assert label_text(tok, ids, labels) == "hello<|im_end|>\nthey run on the cpu<|im_end|>\n"
    assert tok.decode(ids, False).startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    short, short_labels = encode_example(ChatFormat(tok), ex, 10)
    assert len(short) == 10 and short == ids[:10] and short_labels == labels[:10]


def test_alpaca_columns_history_and_openai_messages(tiny_model, data_dir):
    rows = [{"q": "what", "ctx": "now", "a": "this", "hist": [["hi", "yo"]], "sys": "s"}]
    (data_dir / "custom.json").write_text(json.dumps(rows))
    msgs = [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}]
    (data_dir / "oai.json").write_text(json.dumps(msgs))
    info = json.loads((data_dir / "dataset_info.json").read_text())
    cols = {"prompt": "q", "query": "ctx", "response": "a", "history": "hist", "system": "sys"}
    info["custom"] = {"file_name": "custom.json", "columns": cols}
    info["oai"] = {"file_name": "oai.json", "formatting": "sharegpt"}
    (data_dir / "dataset_info.json").write_text(json.dumps(info))
    custom, oai = load_examples(["custom", "oai"], data_dir)
    assert custom.system == "s"
    assert [m["content"] for m in custom.messages] == ["hi", "yo", "what\nnow", "this"]
    assert [m["content"] for m in oai.messages] == ["u", "v"]
    tok = Tokenizer(tiny_model("qwen3-moe"))
    ids, labels = encode_example(ChatFormat(tok, "chatml"), custom, 1024)
    assert label_text(tok, ids, labels) == "yo<|im_end|>\nthis<|im_end|>\n"


def test_reasoning_template_labels_start_after_the_shared_prompt(tiny_model, data_dir):
    # DeepSeek-R1's template ends its generation prompt in "<think>\n", which the rendered
    # history leaves out: the turn's labels are what follows "<｜Assistant｜>" in the history.
    tok = Tokenizer(tiny_model("deepseek-v3"))
    (ex,) = load_examples(["tiny_chat"], data_dir)
    fmt = ChatFormat(tok)
    assert fmt.render(ex, 1, add_generation_prompt=True).endswith("<｜Assistant｜><think>\n")
    ids, labels = encode_example(fmt, ex, 1024)
    eos = "<｜end▁of▁sentence｜>"
    assert label_text(tok, ids, labels) == f"hello{eos}they run on the cpu{eos}"
    assert tok.decode(ids, False) == fmt.render(ex, 4, add_generation_prompt=False)
