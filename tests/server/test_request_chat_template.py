"""vLLM's chat `chat_template` (a request's own template, rendered only where the server runs
with --trust-request-chat-template, in the same sandbox as a model's) and `documents` (RAG
documents the template renders, as transformers' apply_chat_template takes them)."""

import httpx
import pytest

from tests.server.conftest import LiveServer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% for d in documents or [] %}<doc title={{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def trusting(engine):
    srv = LiveServer(engine, trust_request_chat_template=True)
    yield srv
    srv.stop()


def tokenize(srv, body):
    return httpx.post(srv.url + "/tokenize", json=body, timeout=30)


def test_a_requests_template_is_refused_unless_the_server_trusts_them(server):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, timeout=30,
                       json={"messages": MESSAGES, "chat_template": PLAIN, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template"
        assert "--trust-request-chat-template" in err["message"]


def test_a_trusted_requests_template_renders_the_prompt(trusting):
    want = "[system] be brief\n[user] hello\n[assistant] "
    ids = tokenize(trusting, {"prompt": want}).json()["tokens"]
    r = tokenize(trusting, {"messages": MESSAGES, "chat_template": PLAIN})
    assert r.status_code == 200 and r.json()["tokens"] == ids
    r = httpx.post(trusting.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "chat_template": PLAIN, "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    # The model's own template is untouched by the request that came before.
    plain = tokenize(trusting, {"messages": MESSAGES}).json()["tokens"]
    assert plain != ids


def test_documents_reach_the_template(trusting, server):
    docs = [{"title": "moe", "text": "experts on the CPU"}, {"title": "kv", "text": "tiers"}]
    r = tokenize(trusting, {"messages": MESSAGES, "chat_template": PLAIN, "documents": docs})
    want = ("[system] be brief\n[user] hello\n<doc title=moe>experts on the CPU</doc>\n"
            "<doc title=kv>tiers</doc>\n[assistant] ")  # fmt: skip
    assert r.json()["tokens"] == tokenize(trusting, {"prompt": want}).json()["tokens"]
    # The model's own template is given them too (this one has no use for them), also as
    # chat_template_kwargs carries them (vLLM takes both).
    for extra in ({"documents": docs}, {"chat_template_kwargs": {"documents": docs}}):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": MESSAGES, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "extra,param,needle",
    [
        ({"chat_template": "{% for m in messages %}"}, "chat_template", "not a valid Jinja"),
        ({"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}, None,
         "chat template failed"),
        ({"chat_template": ""}, "chat_template", ""),
        ({"documents": [{"title": 3}]}, "documents.0.title", ""),
        ({"documents": "text"}, "documents", ""),
        ({"chat_template": "{{ 1 / 0 }}"}, "chat_template", "ZeroDivisionError"),
        ({"chat_template": "{{ messages[0].content + 1 }}"}, "chat_template", "TypeError"),
        ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}},
         "chat_template_kwargs.chat_template", "send it as the request's chat_template"),
    ],
)
def test_bad_templates_and_documents_are_400s(trusting, extra, param, needle):
    r = httpx.post(trusting.url + "/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert httpx.get(trusting.url + "/health", timeout=10).status_code == 200
