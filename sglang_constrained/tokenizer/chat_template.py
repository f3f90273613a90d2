"""A model's chat template where its tokenizer does not hold it: the one ``--chat-template`` gives (a file, or Jinja
written inline, as SGLang and vLLM take it), checked to compile as transformers compiles chat templates; and the one
a model folder keeps in ``chat_template.json`` (the file transformers' processors write, which a tokenizer does not
read). A GGUF file's ``tokenizer.chat_template`` and a folder's ``tokenizer_config.json`` or ``chat_template.jinja``
come with the tokenizer itself (``tokenizer_loading``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_JSON = "chat_template.json"
JINJA_MARKS = ("{{", "{%")


def read_chat_template(value: str) -> str:
    """The template ``--chat-template value`` names: the text of a file (a JSON file's ``chat_template``, as in
    ``chat_template.json``), else ``value`` itself when it holds Jinja; raises ValueError naming the problem, with the
    line of a template that does not compile."""
    path = Path(value)
    if _is_file(path):
        text = path.read_text(encoding="utf-8")
        template = _json_template(text, value) if path.suffix == ".json" else text
        origin = f"the file {value}"
    elif any(mark in value for mark in JINJA_MARKS):
        template, origin = value, "given inline"
    else:
        raise ValueError(
            f"--chat-template {value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%' in it)"[:300]
        )
    check_compiles(template, f"--chat-template ({origin})")
    return template


def check_compiles(template: str, origin: str) -> None:
    """Raise ValueError, naming ``origin`` and the line, when ``template`` does not compile as a chat template."""
    import jinja2

    try:
        _compiled(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{origin} does not parse: line {e.lineno}: {e.message}") from e


def template_variables(template: str) -> set[str]:
    """The variables a chat template reads from its caller (``messages``, ``tools``, ...); none for a template that
    does not parse."""
    import jinja2
    import jinja2.meta

    try:
        environment = _compiled(template).environment
        return set(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateSyntaxError:
        return set()


def _compiled(template: str) -> Any:
    """``template`` compiled by transformers itself (its sandbox, its ``{% generation %}`` tag), so that what parses
    here is what renders. Imported here, not at the top, because this module is imported by the server's argument
    parsing, which otherwise never imports transformers (half a second)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def folder_chat_template(folder: Path) -> str | None:
    """The template of a model folder's ``chat_template.json``, if it has one."""
    path = folder / CHAT_TEMPLATE_JSON
    if not path.is_file():
        return None
    return _json_template(path.read_text(encoding="utf-8"), str(path))


def _json_template(text: str, origin: str) -> str:
    try:
        template = json.loads(text).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{origin} is not a JSON object with a 'chat_template' string") from e
    if not isinstance(template, str):
        raise ValueError(f"{origin} is not a JSON object with a 'chat_template' string")
    return template


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a long inline template is no file name
        return False
