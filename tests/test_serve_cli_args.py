"""`pagedlab serve` flags checked before the engine loads: `--chat-template` (a template file, or a
template given inline; anything else is refused) and `--response-role` (handed to the server)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedlab.cli.main import main

INLINE = "{% for m in messages %}" + "{{ m['content'] }}\n" * 20 + "{% endfor %}"  # over 255 characters


@pytest.fixture
def engines(monkeypatch) -> list:
    """The engine configs built (none is: the test stops before)."""
    from pagedlab.engine.async_engine import AsyncEngine

    built: list = []

    def refuse(config):
        built.append(config)
        raise ValueError("no engine in this test")

    monkeypatch.setattr(AsyncEngine, "from_engine_config", refuse)
    return built


def test_a_chat_template_path_that_names_no_file_is_refused(tmp_path, engines, capsys):
    """It was taken as the template itself: every chat prompt became the path's text."""
    missing = str(tmp_path / "templats" / "chat.jinja")
    assert main(["serve", "--model", "m", "--chat-template", missing]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {missing!r} is neither a readable file (No such file or directory)" in err
    assert engines == []


def test_a_chat_template_is_read_from_its_file_or_taken_inline(tmp_path):
    from pagedlab.server.cli import chat_template_from_arg

    template = tmp_path / "t.jinja"
    template.write_text(INLINE)
    assert chat_template_from_arg(str(template)) == INLINE
    assert len(INLINE) > 255  # too long for a file name: opening it fails with ENAMETOOLONG, not ENOENT
    assert chat_template_from_arg(INLINE) == INLINE
    assert chat_template_from_arg(None) is None


def test_a_long_inline_chat_template_reaches_the_engine_without_a_traceback(engines, capsys):
    assert main(["serve", "--model", "m", "--chat-template", INLINE]) == 2
    assert "error: no engine in this test" in capsys.readouterr().err
    assert len(engines) == 1


@pytest.mark.parametrize("flags, role", [([], "assistant"), (["--response-role", "narrator"], "narrator")])
def test_response_role_reaches_the_server(monkeypatch, flags, role):
    """vLLM's --response-role (default assistant) is handed to the server that answers chats."""
    from types import SimpleNamespace

    from pagedlab.engine.async_engine import AsyncEngine
    from pagedlab.server import app

    engine = SimpleNamespace(max_model_len=64, get_stats=lambda: SimpleNamespace(num_kv_blocks=4),
                             default_sampling_args={}, shutdown=lambda: None)
    monkeypatch.setattr(AsyncEngine, "from_engine_config", lambda config: engine)
    served: list[dict] = []
    monkeypatch.setattr(app, "run_server", lambda *args, **kwargs: served.append(kwargs))
    assert main(["serve", "--model", "m", *flags]) == 0
    assert [kwargs["response_role"] for kwargs in served] == [role]


@pytest.mark.parametrize("role", ["", "  "])
def test_a_blank_response_role_is_refused(role, engines, capsys):
    """A blank role would be every reply's role: refused before the engine loads."""
    assert main(["serve", "--model", "m", "--response-role", role]) == 2
    assert f"error: --response-role {role!r} is invalid: give a role name such as assistant" in \
        capsys.readouterr().err
    assert engines == []
