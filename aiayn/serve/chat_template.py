"""A chat template carried by a language-model run: ``RUN/chat_template.jinja``, as Hugging Face models carry theirs.

The file is a Jinja template over ``messages`` (``[{"role", "content"}]``, the request's roles as sent, text
parts joined), ``add_generation_prompt`` (always true: the server asks for the assistant's next message),
``bos_token`` and ``eos_token`` (the run's special tokens by their text, as ``/tokenizer_info`` names them), and
``tools`` / ``documents`` (none). It is rendered as ``transformers``' ``apply_chat_template`` renders one: in
jinja2's ``ImmutableSandboxedEnvironment`` (a template from elsewhere is untrusted code) with ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception(message)``, ``strftime_now(format)``, a
``tojson`` that keeps non-ASCII text, and ``{% generation %}`` blocks rendered as their body.

The rendered text becomes the completion's prompt with the special tokens' names in it read as those tokens
(``<s>`` is BOS, ``</s>`` EOS), as a Hugging Face tokenizer reads a rendered chat. A template that does not parse
is refused when the run is served (one line, naming the file and line); one that fails for a request's messages
(``raise_exception``, an undefined operation) answers that request 400 in OpenAI's shape.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from aiayn.errors import ConfigError, one_line
from aiayn.run.directory import Run
from aiayn.serve.errors import OpenAIError

TEMPLATE_FILE = "chat_template.jinja"


def _environment():
    """The Jinja environment Hugging Face renders chat templates in (transformers' ``_compile_jinja_template``)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it; the
        server needs no mask, so the block is its body (without the tag, such a template would not parse)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which a prompt must keep as they are
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A run's parsed chat template: ``source`` (the file's text, what ``/tokenizer_info`` shows), the compiled
    template, and the special tokens' text it is given."""

    source: str
    compiled: Any  # jinja2.Template
    bos_token: str
    eos_token: str

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt of ``messages``; a template that fails for them is a 400 (OpenAI's shape), never a 500."""
        try:
            return self.compiled.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token, tools=None, documents=None)
        except Exception as e:  # whatever the template does wrong is the template's, not the server's, failure
            raise OpenAIError(400, one_line(f"the run's chat template ({TEMPLATE_FILE}) failed for these messages: "
                                            f"{type(e).__name__}: {e}"), param="messages",
                              code="chat_template_error") from None


def load_chat_template(run: Run) -> ChatTemplate | None:
    """``run``'s own chat template, parsed (None: the run has none; a language model's completions ask for it, a
    translation's chat answers the last user message without one). A file that is not UTF-8 or does not parse is
    a one-line ConfigError."""
    path = Path(run.path) / TEMPLATE_FILE
    if not path.is_file():
        return None
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the chat template: {e}") from None
    import jinja2

    try:
        compiled = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{path}: line {e.lineno}: {e.message} (a Jinja chat template over messages, "
                          "add_generation_prompt, bos_token, eos_token)") from None
    except jinja2.TemplateError as e:
        raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
    tok, sp = run.tokenizers.src, run.tokenizers.specials
    return ChatTemplate(source, compiled, tok.id_to_piece(sp.bos), tok.id_to_piece(sp.eos))
