"""Strings that are not Unicode text refused at the door, naming the field.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`): Python's `json` decodes it into a `str`
holding a code point that no UTF-8 encoder accepts, so it passes every type check and then
breaks whatever encodes it later: the tokenizer (TypeError), SQLite (UnicodeEncodeError), a
log line, a response. Raw bytes cannot carry one (UTF-8 has no encoding for a surrogate and a
body that is not UTF-8 is already refused), so only the `\\u` escape needs looking for, and a
body without one is passed through without a walk."""

from __future__ import annotations

import re
from typing import Any

from lorafleet.server.errors import UserError

# a \u escape of a surrogate, high (D800-DBFF) or low (DC00-DFFF), in the raw JSON
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidText(UserError):
    """A string that is not valid Unicode; `param` names the field (OpenAI's `error.param`)."""

    def __init__(self, param: str):
        super().__init__(
            f"{param} is not valid Unicode text: it holds a lone UTF-16 surrogate (a \\ud800-"
            "\\udfff escape without its pair); send UTF-8 text"
        )
        self.param = param


def _where(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def invalid_text_field(value: Any, path: str = "") -> str | None:
    """The path (`messages[2].content`) of the first string in `value`, key or value, that is
    not valid Unicode; None when there is none. Iterative: nesting depth is the JSON parser's
    to bound, not this walk's."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return where or "body"
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                if isinstance(key, str) and _SURROGATE.search(key):
                    return f"{_where(where, '?')} (a key)" if where else "a key of the body"
                stack.append((child, _where(where, key)))
        elif isinstance(item, list):
            stack.extend((child, _where(where, i)) for i, child in reversed(list(enumerate(item))))
    return None


def check_text(raw: bytes, value: Any) -> None:
    """Raises InvalidText naming the field when the parsed JSON `value` of body `raw` holds a
    string that is not valid Unicode."""
    if not _ESCAPED_SURROGATE.search(raw):
        return
    field = invalid_text_field(value)
    if field is not None:
        raise InvalidText(field)


def check_string(value: str, field: str) -> None:
    """One string from elsewhere than a JSON body (a query parameter, a form field)."""
    if _SURROGATE.search(value):
        raise InvalidText(field)
