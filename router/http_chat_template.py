"""Chat templates of the OpenAI front: the model's Jinja template, found and compiled as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

from baton.engine.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from baton.router.http_errors import ApiError

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def load_chat_template(tokenizer_path: str | None) -> str | None:
    """The model's chat template (Jinja source): `chat_template.jinja` beside the tokenizer, else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: "default" wins)."""
    if not tokenizer_path:
        return None
    p = Path(tokenizer_path)
    d = p.parent if p.name == TOKENIZER_FILE else p
    if (d / CHAT_TEMPLATE_FILE).is_file():
        return (d / CHAT_TEMPLATE_FILE).read_text()
    cfg_path = d / TOKENIZER_CONFIG_FILE
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        t = named.get("default", next(iter(named.values()), None))
    return t if isinstance(t, str) and t else None


class ChatTemplate:
    """A chat template compiled as transformers does (sandboxed Jinja, `trim_blocks`, `lstrip_blocks`,
    `raise_exception`, a JSON `tojson`). Needs jinja2, imported only when a model has a template."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat_template: does not compile: {e}") from e
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
               ) -> str:
        # `tools` only where given: templates test `tools is defined` as transformers passes them.
        extra = {} if tools is None else {"tools": tools}
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except RecursionError:
            raise ApiError(400, "messages: the chat template recursed too deeply on them",
                           param="messages") from None
        # The template is the model's code run on the client's messages: whatever it raises (TemplateError,
        # or a TypeError on a field of an unexpected type) is about the messages.
        except Exception as e:
            raise ApiError(400, f"messages: the chat template refused them: {str(e)[:500]}",
                           param="messages") from e
