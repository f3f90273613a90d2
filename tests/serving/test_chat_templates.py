"""The model's own chat template, rendered as written: a GGUF file's ``tokenizer.chat_template`` and a folder's (each
file transformers writes it to), or ``--chat-template`` (a file or inline) instead; ``tools``, ``documents`` and
``chat_template_kwargs`` reach the template; the system message offering tools only where the template renders none;
a template that does not parse stops the start-up, and messages a template refuses are a 400 naming its reason.

The expected prompts are rendered by jinja2 itself from the template text, then tokenised: an oracle independent of
the tokenizer's ``apply_chat_template``. The model is a tiny random-weight Llama written as a GGUF file by ``gguf``'s
writer (``tests.tiny_models``), carrying the template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from scheduler.http.protocol import ChatCompletionRequest
from scheduler.http.request_conversion import RequestLimits, chat_calls
from scheduler.http.server import start_http_frontend
from scheduler.http.tool_calls import server_tool_format, tool_plan
from scheduler.prompt_encoder import PromptEncoder
from scheduler.server_args import ModelArgs, ServerArgs, free_port, parse_server_args
from sglang_constrained.tokenizer.loading import load_tokenizer
from tests.helpers import HttpServer, serving
from tests.tiny_models import tiny_tokenizer, write_gguf

VOCAB = 300
MAX_SEQ_LEN = 256
HOUSE_TEMPLATE = (
    "{%- if messages[0].role == 'assistant' %}{{ raise_exception('the first message must not be the assistant') }}"
    "{%- endif %}<<{{ house_style | default('plain') }}>>"
    "{%- if tools %}[TOOLS]{% for tool in tools %}{{ tool.function.name }};{% endfor %}[/TOOLS]{% endif %}"
    "{%- if documents %}[DOCS]{% for doc in documents %}{{ doc.title }}={{ doc.text }};{% endfor %}[/DOCS]{% endif %}"
    "{%- for message in messages %}#{{ message.role }}: {{ message.content }}<|endoftext|>{% endfor %}"
    "{%- if add_generation_prompt %}#assistant:{% endif %}"
)
"""The GGUF file's template: it renders tools, documents and a variable of its own, and refuses a conversation
opened by the assistant."""
PLAIN_TEMPLATE = (
    "{%- for message in messages %}({{ message.role }}) {{ message.content }}{% endfor %}"
    "{%- if add_generation_prompt %}(assistant){% endif %}"
)
"""A template that renders no tools (as SmolLM2's)."""
MESSAGES = [{"role": "user", "content": "fib(2)?"}]
TOOLS = [{"type": "function", "function": {"name": "fib", "parameters": {"type": "object"}}}]
DOCUMENTS = [{"title": "def", "text": "fib(n) = n if n < 2"}]


def rendered(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """The template rendered by jinja2 alone, the generation prompt added."""
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True, **variables)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def model_file(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama as a GGUF file whose metadata carries ``HOUSE_TEMPLATE``."""
    path = tmp_path_factory.mktemp("model") / "house.gguf"
    write_gguf(tiny_llama(), tokenizer, path, chat_template=HOUSE_TEMPLATE)
    return path


def tiny_llama() -> Any:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_SEQ_LEN,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def encoder(model_path: Path, cache: Path, chat_template: str | None = None) -> PromptEncoder:
    tokenizer = load_tokenizer(model_path, cache, chat_template)
    return PromptEncoder(tokenizer, len(tokenizer), MAX_SEQ_LEN)


def test_a_gguf_files_own_template_renders_the_prompt_with_tools_documents_and_kwargs(
    model_file: Path, tmp_path: Path
) -> None:
    """As converted, and as read back from the conversion's cache."""
    for _ in ("converted", "cached"):
        prompts = encoder(model_file, tmp_path)
        ids = prompts.encode(
            messages=MESSAGES, tools=TOOLS, documents=DOCUMENTS, chat_template_kwargs={"house_style": "terse"}
        )
        text = rendered(HOUSE_TEMPLATE, MESSAGES, tools=TOOLS, documents=DOCUMENTS, house_style="terse")
        assert "[TOOLS]fib;[/TOOLS][DOCS]def=fib(n) = n if n < 2;[/DOCS]" in text and "<<terse>>" in text
        assert ids == prompts.tokenizer.encode(text, add_special_tokens=False)
        assert prompts.encode(messages=MESSAGES) == prompts.tokenizer.encode(
            rendered(HOUSE_TEMPLATE, MESSAGES), add_special_tokens=False
        )


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja", "chat_template.json"])
def test_a_model_folders_template_is_read_from_each_file_transformers_writes_it_to(
    where: str, tokenizer: Any, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if where == "tokenizer_config.json":
        config = json.loads((folder / where).read_text()) | {"chat_template": HOUSE_TEMPLATE}
        (folder / where).write_text(json.dumps(config))
    elif where == "chat_template.jinja":
        (folder / where).write_text(HOUSE_TEMPLATE)
    else:
        (folder / where).write_text(json.dumps({"chat_template": HOUSE_TEMPLATE}))
    prompts = encoder(folder, tmp_path / "cache")
    ids = prompts.encode(messages=MESSAGES, documents=DOCUMENTS)
    assert ids == tokenizer.encode(rendered(HOUSE_TEMPLATE, MESSAGES, documents=DOCUMENTS), add_special_tokens=False)


@pytest.mark.parametrize("how", ["a .jinja file", "a .json file", "inline"])
def test_the_chat_template_flag_replaces_the_models_template(how: str, model_file: Path, tmp_path: Path) -> None:
    value = PLAIN_TEMPLATE
    if how == "a .jinja file":
        value = str(tmp_path / "plain.jinja")
        Path(value).write_text(PLAIN_TEMPLATE)
    elif how == "a .json file":
        value = str(tmp_path / "plain.json")
        Path(value).write_text(json.dumps({"chat_template": PLAIN_TEMPLATE}))
    assert ModelArgs(chat_template=value).chat_template == value
    prompts = encoder(model_file, tmp_path / "cache", value)
    assert prompts.encode(messages=MESSAGES) == prompts.tokenizer.encode(
        rendered(PLAIN_TEMPLATE, MESSAGES), add_special_tokens=False
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{% for message in messages %}{{ message.content }", "--chat-template (given inline) does not parse: line 1"),
        ("{% if %}\n{% endif %}", "does not parse: line 1: Expected an expression"),
        ("templates/missing.jinja", "is neither a file nor a Jinja template"),
    ],
)
def test_a_chat_template_that_does_not_parse_stops_the_start_up_naming_the_fault(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_server_args(["--chat-template", value])


@pytest.mark.parametrize("template", [HOUSE_TEMPLATE, PLAIN_TEMPLATE], ids=["renders tools", "renders no tools"])
def test_tools_are_offered_in_a_system_message_only_where_the_template_renders_none(
    template: str, model_file: Path, tmp_path: Path
) -> None:
    """A chat completion with tools, as the HTTP frontend converts and tokenises it."""
    prompts = encoder(model_file, tmp_path, template)
    tool_format = server_tool_format(None, prompts.tokenizer)
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    plan = tool_plan(request, tool_format.syntax)
    (call,) = chat_calls(request, "rid", RequestLimits(MAX_SEQ_LEN, 1 << 20), plan, tool_format)
    assert call.messages is not None
    text = prompts.tokenizer.decode(prompts.encode(messages=call.messages, tools=call.tools))
    if template == HOUSE_TEMPLATE:
        assert tool_format.template_renders_tools
        assert text == rendered(template, MESSAGES, tools=TOOLS) and "You can call these functions" not in text
    else:
        assert not tool_format.template_renders_tools
        system, user = call.messages
        assert user == MESSAGES[0] and system["role"] == "system"
        assert system["content"].startswith("You can call these functions:\n")
        assert '"name": "fib"' in system["content"] and text == rendered(template, call.messages)


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_of_named_templates_the_tool_use_one_renders_requests_with_tools(
    source: str, tokenizer: Any, tmp_path: Path
) -> None:
    """A folder or a GGUF file with several named templates (``tokenizer_config.json``'s list; llama.cpp's
    ``tokenizer.chat_template.tool_use``), as Hermes-style models ship: tools go to its ``tool_use`` template, which
    renders them and whose markers name the call syntax (Qwen2.5's, in a comment that renders nothing); a chat without
    tools gets the default one."""
    qwen25_house = HOUSE_TEMPLATE + "{# <tool_call> <args-json-object> #}"
    named = [{"name": "default", "template": PLAIN_TEMPLATE}, {"name": "tool_use", "template": qwen25_house}]
    model = tmp_path / "model"
    if source == "folder":
        tokenizer.save_pretrained(model)
        (model / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((model / "tokenizer_config.json").read_text()) | {"chat_template": named}
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        model = tmp_path / "named.gguf"
        write_gguf(tiny_llama(), tokenizer, model, chat_template=named)
    for _ in ("converted", "cached"):
        prompts = encoder(model, tmp_path / "cache")
        tool_format = server_tool_format(None, prompts.tokenizer)
        assert tool_format.template_renders_tools and tool_format.syntax.name == "qwen25"
        with_tools = prompts.tokenizer.decode(prompts.encode(messages=MESSAGES, tools=TOOLS))
        assert with_tools == rendered(HOUSE_TEMPLATE, MESSAGES, tools=TOOLS)
        assert prompts.tokenizer.decode(prompts.encode(messages=MESSAGES)) == rendered(PLAIN_TEMPLATE, MESSAGES)


@pytest.fixture(scope="module")
def house_server(model_file: Path) -> Iterator[HttpServer]:
    """The tiny model served with its own template."""
    live = HttpServer("--model-path", str(model_file), "--max-seq-len", str(MAX_SEQ_LEN))
    with serving(live):
        yield live


def test_the_server_renders_chats_by_the_files_template_and_answers_its_refusals_with_a_400(
    house_server: HttpServer, tokenizer: Any
) -> None:
    """``/tokenize`` gives the ids the template's rendering has, with tools, documents and kwargs; a chat completion
    sends the same prompt to the model; a conversation the template refuses is a 400 naming the template's reason,
    and the server goes on serving."""
    http = house_server.http
    chat = {"messages": MESSAGES, "tools": TOOLS, "documents": DOCUMENTS, "chat_template_kwargs": {"house_style": "x"}}
    tokenized = http.post("/tokenize", json=chat)
    assert tokenized.status_code == 200, tokenized.text
    text = rendered(HOUSE_TEMPLATE, MESSAGES, tools=TOOLS, documents=DOCUMENTS, house_style="x")
    assert tokenized.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    completion = http.post("/v1/chat/completions", json=chat | {"max_tokens": 2, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == tokenized.json()["count"]
    refused = [{"role": "assistant", "content": "I start."}, *MESSAGES]
    for route in ("/v1/chat/completions", "/tokenize"):
        answer = http.post(
            route, json={"messages": refused, "max_tokens": 2} if "chat" in route else {"messages": refused}
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (
            error["message"] == "the chat template refused these messages: the first message must not be the assistant"
        )
        assert error["param"] == "messages"
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200


def test_the_http_frontend_renders_chats_by_the_chat_template_flag(model_file: Path, tokenizer: Any) -> None:
    """The frontend process renders chat prompts, so ``--chat-template`` reaches it as well as the model's loader
    (``/tokenize`` answers without a scheduler)."""
    host = "127.0.0.1"
    args = ServerArgs.of(
        model_path=str(model_file),
        max_seq_len=MAX_SEQ_LEN,
        chat_template=PLAIN_TEMPLATE,
        host=host,
        port=free_port(host),
        zmq_port=free_port(host),
    )
    frontend = start_http_frontend(args)
    try:
        answer = httpx.post(f"{frontend.url}/tokenize", json={"messages": MESSAGES}, timeout=120)
    finally:
        frontend.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == tokenizer.encode(rendered(PLAIN_TEMPLATE, MESSAGES), add_special_tokens=False)
