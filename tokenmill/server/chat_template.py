"""``--chat-template``: a Jinja file, or the template itself, in place of the model's (vLLM's rule for telling
them apart: what cannot be opened as a file and holds a Jinja character is the template)."""

from __future__ import annotations

import codecs
from pathlib import Path

from tokenmill.tokenizer import compile_chat_template

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template's text, checked to parse; a ValueError saying what is wrong otherwise."""
    path = Path(value)
    try:
        text = path.read_text(encoding="utf-8")
        source = f"file {value}"
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {value}: not UTF-8 text") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        if not any(c in value for c in _JINJA_CHARS):
            reason = getattr(e, "strerror", None) or str(e)
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read "
                             f"({reason})") from None
        # given inline: escapes such as \n written on a command line mean what they say
        try:
            text = codecs.decode(value, "unicode_escape")
        except UnicodeError:  # characters beyond Latin-1: taken as written
            text = value
        source = "inline template"
    if not text.strip():
        raise ValueError(f"--chat-template ({source}) is empty")
    try:
        compile_chat_template(text)
    except ValueError as e:
        raise ValueError(f"--chat-template ({source}) does not parse as a Jinja template: {e.__cause__ or e}"
                         ) from None
    return text
