"""One row's checks, shared by every format: fields, texts, message lists and completions.

Each check raises :class:`BadRow` with a skip-mode counter key and a one-line detail that names the
key; the caller adds the file and the row.  No torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable

CHAT_ROLES = ("system", "user", "assistant")


class BadRow(Exception):
    """One row's problem: ``reason`` is the counter key of skip mode, ``detail`` the human message."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def every_field(checks: dict[str, Callable[[], object]]) -> dict:
    """Each field's check run, so that a row with several faults names them all: one BadRow (the first fault's
    reason, for skip mode's counts, and every detail), or the fields' values."""
    values, problems = {}, []
    for name, check in checks.items():
        try:
            values[name] = check()
        except BadRow as problem:
            problems.append(problem)
    if problems:
        raise BadRow(problems[0].reason, " and ".join(problem.detail for problem in problems))
    return values


def kind_of(value) -> str:
    """JSON-ish name of a value's type, for messages."""
    names = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def field_value(row: dict, key: str):
    if key not in row:
        raise BadRow("missing_field", f"field '{key}' is missing")
    if row[key] is None:
        raise BadRow("null_field", f"field '{key}' is null")
    return row[key]


def text_value(row: dict, key: str, completion: bool) -> str:
    value = field_value(row, key)
    if not isinstance(value, str):
        raise BadRow("non_string_field", f"field '{key}' must be a string, got {kind_of(value)}")
    if completion and not value.strip():
        raise BadRow("empty_completion", f"field '{key}' is an empty completion")
    return value


def message_list(value, key: str, role_key="role", content_key="content", roles=None) -> list[dict]:
    """A message list normalized to [{role, content}]; ``roles`` maps source role names to chat roles."""
    roles = roles or {role: role for role in CHAT_ROLES}
    if not isinstance(value, list) or not value:
        got = "no messages" if isinstance(value, list) else kind_of(value)
        raise BadRow("malformed_messages", f"field '{key}' must be a non-empty list of messages, got {got}")
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict) or message.get(role_key) is None or message.get(content_key) is None:
            raise BadRow(
                "malformed_messages",
                f"{key}[{j}] must be an object with '{role_key}' and '{content_key}', got {json.dumps(message)[:80]}",
            )
        role, content = message[role_key], message[content_key]
        if not isinstance(content, str):
            raise BadRow("non_string_field", f"{key}[{j}].{content_key} must be a string, got {kind_of(content)}")
        if role not in roles:
            raise BadRow("unknown_role", f"{key}[{j}] has unknown role {role!r}; expected one of {', '.join(roles)}")
        messages.append({"role": roles[role], "content": content})
    return messages


def completion_messages(messages: list[dict], key: str, spelling: dict | None = None) -> list[dict]:
    """``messages`` as a completion (assistant turns only); ``spelling`` maps chat roles back to the file's names."""
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            role = (spelling or {}).get(message["role"], message["role"])
            detail = f"{key}[{j}] has role '{role}'; a completion is assistant messages"
            raise BadRow("completion_not_assistant", detail)
    if not "".join(m["content"] for m in messages).strip():
        raise BadRow("empty_completion", f"field '{key}' is an empty completion")
    return messages

