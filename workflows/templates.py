"""Prompt and `run` templates: `{{ task.title }}`, `{{ steps.plan.output }}`.

Deliberately tiny instead of Django's engine: Django autoescapes HTML and
renders unknown names as empty strings, and both are wrong here — a typo in
a workflow must fail loudly, and `run` commands need *shell* quoting.

A placeholder is `{{ name }}` or `{{ name.key.key }}` (spaces inside the braces
optional); the first name comes from the context, each further key walks into
a dict (or a list, by index). Braces that do not hold a dotted name — such as
Go templates `{{.State}}` in a `docker inspect --format` — are left alone.

With `shell=True` every substituted value is `shlex.quote`d, so task text is
always one shell word. For that to hold the placeholder must stand outside
any quotes in the command: `echo "{{ task.title }}"` would put the quoted
value inside double quotes, where `$(…)` still runs, so it is rejected.
"""

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_]\w*(?:\.[\w-]+)*)\s*\}\}")


class TemplateError(ValueError):
    """A template names something the context does not have, or is unsafe."""


def render(template: str, context: Mapping[str, Any], *, shell: bool = False) -> str:
    """Substitute every placeholder of `template` from `context`."""
    out: list[str] = []
    position = 0
    quote_state = _QuoteState()
    for match in _PLACEHOLDER.finditer(template):
        literal = template[position : match.start()]
        out.append(literal)
        if shell:
            quote_state.feed(literal)
            problem = quote_state.problem()
            if problem:
                raise TemplateError(
                    f"placeholder {{{{ {match.group(1)} }}}} is {problem} in a shell command; "
                    "write it unquoted — its value is shell-quoted for you"
                )
        text = _to_text(_lookup(match.group(1), context))
        out.append(shlex.quote(text) if shell else text)
        position = match.end()
    out.append(template[position:])
    return "".join(out)


def _lookup(dotted: str, context: Mapping[str, Any]) -> Any:
    head, *rest = dotted.split(".")
    if head not in context:
        known = ", ".join(sorted(context)) or "nothing"
        raise TemplateError(f"unknown name '{dotted}' in template: '{head}' is not defined (known: {known})")
    value = context[head]
    walked = head
    for key in rest:
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, Sequence) and not isinstance(value, str) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise TemplateError(f"unknown name '{dotted}' in template: '{walked}' has no '{key}'")
        walked = f"{walked}.{key}"
    return value


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        # "None" in a prompt or command is a Python leak, never what the author meant.
        return ""
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return str(value)


class _QuoteState:
    """Tracks whether the shell text seen so far leaves us inside '…' or "…".

    Enough of POSIX sh lexing to catch a placeholder wrapped in quotes:
    single quotes, double quotes, backslash escapes outside single quotes,
    comments, and here-documents (`<<`, not the here-string `<<<`).
    """

    def __init__(self) -> None:
        self.inside: str | None = None  # None, "single" or "double"
        self._escaped = False
        self._angle_run = 0  # consecutive unquoted '<'
        self.heredoc = False
        self._comment = False
        self._previous = "\n"

    def problem(self) -> str | None:
        """Why a quoted word may not start here, or None when it may."""
        if self.inside:
            return f"inside {self.inside} quotes"
        if self._comment:
            # In a comment quotes mean nothing and a newline in the value would end the comment.
            return "inside a comment"
        if self._escaped:
            # `\{{ x }}` would escape the opening quote of the value and unquote the rest.
            return "preceded by a backslash"
        if self.heredoc or self._angle_run == 2:
            # Inside a here-document quotes are plain text and `$(…)` runs, so quoting cannot
            # protect a value; we cannot tell where the document ends, so refuse after any `<<`.
            return "after a here-document (<<); pass task text through $APIARY_TASK_* variables"
        return None

    def feed(self, text: str) -> None:
        for char in text:
            previous, self._previous = self._previous, char
            if self._comment:
                # Quotes in a comment (`# don't`) are not quotes.
                self._comment = char != "\n"
                continue
            if char == "#" and self.inside is None and not self._escaped and previous in " \t\n;&|()":
                self._comment = True
                continue
            if char == "<" and not self._escaped and self.inside is None:
                self._angle_run += 1
                continue
            if self._angle_run == 2:
                self.heredoc = True
            self._angle_run = 0
            if self._escaped:
                self._escaped = False
            elif self.inside == "single":
                if char == "'":
                    self.inside = None
            elif char == "\\":
                self._escaped = True
            elif self.inside == "double":
                if char == '"':
                    self.inside = None
            elif char == "'":
                self.inside = "single"
            elif char == '"':
                self.inside = "double"
