"""Prompt and `run` templates: `{{ task.title }}`, `{{ steps.plan.output }}`.

Deliberately tiny instead of Django's engine: Django autoescapes HTML and
renders unknown names as empty strings, and both are wrong here — a typo in
a workflow must fail loudly, and `run` commands need *shell* quoting.

A placeholder is `{{ name }}` or `{{ name.key.key }}` (spaces inside the braces
optional); the first name comes from the context, each further key walks into
a dict (or a list, by index). Braces that do not hold a dotted name — such as
Go templates `{{.State}}` in a `docker inspect --format` — are left alone.

In a `run` command (`render_command`, what the executor uses) a placeholder
becomes `"$APIARY_T_1"`, `"$APIARY_T_2"`, … and its value goes into the step's
environment under that name: the shell expands each to exactly its value, one
word, and never parses the value as shell text, so no quoting mistake of ours
(or quirk of a shell we do not model) can turn task text into code.
`render(…, shell=True)` is the same command with each value `shlex.quote`d in
place, for a self-contained string. In both the placeholder must stand outside
any quotes in the command (inside them the reference would be text, or the
value's quoting undone): `echo "{{ task.title }}"` would put the quoted
value inside double quotes, where `$(…)` still runs, so it is rejected.
So is one inside bash's `$'…'`, or right after a `$`. So is a placeholder inside arithmetic (`$(( … ))`, `$[ … ]`, bash's `(( … ))`),
whose expression is expanded as if double-quoted — single quotes there are
literal characters and a quoted `$(…)` runs — and inside backquotes, which
re-parse their text so a backquote in the value would end them. (A value is
one shell word; bash still evaluates a word as arithmetic in `let`,
`[[ … -eq … ]]` and array subscripts, where `a[$(cmd)]` runs `cmd` whether it
came from a placeholder or a variable: check such values are numbers first.)
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
    """Substitute every placeholder of `template` from `context`. With
    `shell=True` each value is spliced in `shlex.quote`d: one self-contained
    command string (what a person would type). Steps do not run this form:
    the executor uses `render_command`, where no task text is in the command."""
    return _render(template, context, shell=shell, substitute=shlex.quote if shell else str)


VALUE_VARIABLE = "APIARY_T_{n}"  # the environment variable of a `run` command's n-th placeholder


def render_command(template: str, context: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """A `run` command and the environment it needs: placeholder n becomes
    `"$APIARY_T_n"` (a double-quoted parameter expansion, which the shell
    expands to exactly the value, as one word, and never parses again) and
    its value goes into the environment under that name. The placeholders
    refused by `render(shell=True)` are refused here too, so a template that
    renders means the same in both forms."""
    env: dict[str, str] = {}

    def reference(text: str) -> str:
        name = VALUE_VARIABLE.format(n=len(env) + 1)
        env[name] = text
        return f'"${name}"'

    return _render(template, context, shell=True, substitute=reference), env


def _render(template: str, context: Mapping[str, Any], *, shell: bool, substitute) -> str:
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
                where, advice = problem
                raise TemplateError(f"placeholder {{{{ {match.group(1)} }}}} is {where} in a shell command; {advice}")
        out.append(substitute(_to_text(_lookup(match.group(1), context))))
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


_UNQUOTE = "write it unquoted — its value is shell-quoted for you"
_VIA_VARIABLE = (
    "quoting cannot protect a value there; assign it to a variable outside "
    "(n={{ … }}) and check it is a number before using it"
)


_QUOTE_NAMES = {"single": "single", "double": "double", "ansi": "$'…'"}


class _QuoteState:
    """Tracks whether the shell text seen so far leaves us inside '…' or "…",
    arithmetic or backquotes.

    Enough of POSIX sh (and bash) lexing to catch a placeholder wrapped in
    quotes: single quotes, double quotes, bash's `$'…'` (inside which a
    backslash escapes, so `\'` does not end it), backslash escapes outside
    single quotes, a `$` right before the placeholder,
    comments, here-documents (`<<`, not the here-string `<<<`), arithmetic
    (`$((`, bash's `((` and `$[`, by counting brackets until they close) and
    backquotes.
    """

    def __init__(self) -> None:
        self.inside: str | None = None  # None, "single", "double" or "ansi" ($'…', where \ escapes)
        self._escaped = False
        self._angle_run = 0  # consecutive unquoted '<'
        self.heredoc = False
        self._comment = False
        self._previous = "\n"
        self._recent = ""  # the last two characters outside single quotes and escapes
        self._parens = 0  # open '(' of an arithmetic $(( … )) or (( … )), 0 outside
        self._brackets = 0  # open '[' of a $[ … ], 0 outside
        self._backquoted = False
        self._dollar = False  # the last character was an unquoted, unescaped `$`

    def problem(self) -> tuple[str, str] | None:
        """(where, advice) when a quoted word may not start here, or None when it may."""
        if self.inside:
            return f"inside {_QUOTE_NAMES[self.inside]} quotes", _UNQUOTE
        if self._dollar:
            # `$'…'` and `$"…"` are quotes of their own in bash: `${{ x }}` would begin one with the value.
            return "right after a $", _UNQUOTE
        if self._comment:
            # In a comment quotes mean nothing and a newline in the value would end the comment.
            return "inside a comment", _UNQUOTE
        if self._escaped:
            # `\{{ x }}` would escape the opening quote of the value and unquote the rest.
            return "preceded by a backslash", _UNQUOTE
        if self.heredoc or self._angle_run == 2:
            # Inside a here-document quotes are plain text and `$(…)` runs, so quoting cannot
            # protect a value; we cannot tell where the document ends, so refuse after any `<<`.
            return "after a here-document (<<)", "pass task text through $APIARY_TASK_* variables"
        if self._parens or self._brackets:
            # The expression is expanded as if double-quoted: '$(cmd)' runs cmd.
            return "inside arithmetic $(( … )) / (( … )) / $[ … ]", _VIA_VARIABLE
        if self._backquoted:
            # The text between backquotes is parsed again; a backquote in the value ends them.
            return "inside backquotes `…`", "use $( … ) instead of backquotes, and write the placeholder unquoted"
        return None

    def feed(self, text: str) -> None:
        for char in text:
            previous, self._previous = self._previous, char
            dollar, self._dollar = self._dollar, False
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
            if self.inside in ("single", "ansi") or self._escaped:
                self._recent = ""
            else:
                self._track_brackets(char)
            if self._escaped:
                self._escaped = False
            elif self.inside == "single":
                if char == "'":
                    self.inside = None
            elif self.inside == "ansi":
                # bash's ANSI-C quotes: `\'` is a quote character inside them, not their end.
                if char == "\\":
                    self._escaped = True
                elif char == "'":
                    self.inside = None
            elif char == "\\":
                self._escaped = True
            elif char == "`":
                self._backquoted = not self._backquoted
            elif self.inside == "double":
                if char == '"':
                    self.inside = None
            elif char == "'":
                self.inside = "ansi" if dollar else "single"
            elif char == '"':
                self.inside = "double"
            elif char == "$":
                self._dollar = True

    def _track_brackets(self, char: str) -> None:
        """Arithmetic opens with `((` (also the tail of `$((`) or `$[` and lasts
        until its brackets balance; brackets count inside it only."""
        recent, self._recent = self._recent, (self._recent + char)[-2:]
        if self._parens:
            self._parens += {"(": 1, ")": -1}.get(char, 0)
        elif self._brackets:
            self._brackets += {"[": 1, "]": -1}.get(char, 0)
        elif char == "(" and recent.endswith("(") and (self.inside is None or recent == "$("):
            self._parens = 2  # inside "…" only `$((` opens arithmetic; `((` there is text
        elif char == "[" and recent.endswith("$"):
            self._brackets = 1
