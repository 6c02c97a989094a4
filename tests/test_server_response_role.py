"""vLLM's ``--response-role``: the role of a chat reply when the request's ``add_generation_prompt``
is true (default "assistant"); with it false the reply continues the last message and takes its
role. Checked in the non-streamed message and in each choice's first streamed delta, on a tiny
random Llama served live on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from pagedlab import LLM
from pagedlab.engine.async_engine import AsyncEngine
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES)
    engine = AsyncEngine.from_llm(llm)
    yield engine
    engine.shutdown()
    llm.close()


def _roles(url: str, body: dict) -> tuple[list[str], list[str]]:
    """The role of each choice's message, and of each choice's first streamed delta."""
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message_roles = [c["message"]["role"] for c in r.json()["choices"]]
    first_delta_roles: dict[int, str | None] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[len("data: "):])["choices"]:
                    first_delta_roles.setdefault(c["index"], c["delta"].get("role"))
    return message_roles, [first_delta_roles[i] for i in sorted(first_delta_roles)]


@pytest.mark.parametrize("response_role, add_generation_prompt, want", [
    (None, True, "assistant"),  # the default, as vLLM's
    ("narrator", True, "narrator"),
    ("narrator", False, "user"),  # no generation prompt: the last message's role, whatever the flag
])
def test_reply_role(engine, response_role, add_generation_prompt, want):
    options = {} if response_role is None else {"response_role": response_role}
    app = build_app(engine, served_model_names=[MODEL], enable_metrics=False, **options)
    body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": add_generation_prompt,
            "max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 1}
    with ServerThread(app) as srv:
        assert _roles(srv.url, body) == ([want, want], [want, want])
