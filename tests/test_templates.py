import subprocess

import pytest

from workflows import templates
from workflows.templates import TemplateError, render

CONTEXT = {
    "task": {"id": 7, "title": "Fix login", "payload": {"priority": "high", "tags": ["a", "b"], "n": 3, "none": None}},
    "steps": {"plan": {"output": "1. do it\n"}},
}


def test_dotted_lookup_with_and_without_spaces():
    assert render("{{ task.title }}|{{task.payload.priority}}|{{  steps.plan.output  }}", CONTEXT) == (
        "Fix login|high|1. do it\n"
    )


def test_non_strings_render_as_json_or_str():
    assert render("{{ task.payload.tags }} {{ task.id }} {{ task.payload.n }}", CONTEXT) == '["a", "b"] 7 3'
    assert render("{{ task.payload }}", {"task": {"payload": {"b": 1, "a": 2}}}) == '{"a": 2, "b": 1}'
    assert render("[{{ task.payload.none }}]", CONTEXT) == "[]"
    assert render("{{ task.payload.tags.1 }}", CONTEXT) == "b"


@pytest.mark.parametrize(
    "template, named",
    [
        ("{{ tsak.title }}", "tsak.title"),
        ("{{ task.titel }}", "task.titel"),
        ("{{ steps.build.output }}", "steps.build"),
    ],
)
def test_unknown_name_is_an_error_naming_it(template, named):
    with pytest.raises(TemplateError) as exc:
        render(template, CONTEXT)
    assert named in str(exc.value)


def test_text_that_is_not_a_placeholder_is_left_alone():
    template = "docker inspect --format '{{.State.Status}}' x; echo { not } {{ }}"
    assert render(template, CONTEXT, shell=True) == template


def test_prompt_values_are_not_quoted():
    assert render("Title: {{ task.title }}", {"task": {"title": "it's $HOME"}}) == "Title: it's $HOME"


HOSTILE = [
    "'; rm -rf / #",
    '"; touch pwned; echo "',
    "$(touch pwned)",
    "`touch pwned`",
    "a\nb; touch pwned",
    "*",
    "-n",
    "",
]


@pytest.mark.parametrize("title", HOSTILE)
def test_shell_rendering_passes_hostile_text_as_one_word(tmp_path, title):
    command = render("printf '%s\\0' {{ task.title }} end", {"task": {"title": title}}, shell=True)
    out = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [title.encode(), b"end"]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "template",
    [
        'echo "{{ task.title }}"',
        "echo 'x{{ task.title }}'",
        "echo \\{{ task.title }}",
        "echo hi # {{ task.title }}",
        "cat <<EOF\n{{ task.title }}\nEOF",
    ],
)
def test_shell_placeholders_where_quoting_cannot_protect_are_rejected(template):
    with pytest.raises(TemplateError):
        render(template, {"task": {"title": "x"}}, shell=True)


def test_quotes_and_comments_before_a_placeholder_are_tracked(tmp_path):
    template = "# it's fine\necho \"a'b\" 'c\"d' \\' {{ task.title }}"
    command = render(template, {"task": {"title": "$(touch pwned)"}}, shell=True)
    out = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out == "a'b c\"d ' $(touch pwned)\n"
    assert not (tmp_path / "pwned").exists()


def test_here_string_is_not_a_here_document():
    assert render("cat <<< {{ task.title }}", {"task": {"title": "a b"}}, shell=True) == "cat <<< 'a b'"


# Inside arithmetic the expression is expanded as if double-quoted: single quotes are literal
# characters there, so a quoted `$(…)` still runs. Backquotes re-parse their text, and a
# backquote in the value would end them. Each template runs with sh after rendering (when it
# renders at all) so a missed case shows up as a created file, not only as a missing error.
ARITHMETIC_AND_BACKQUOTES = [
    "echo $(( {{ task.title }} + 1 ))",
    "echo $((1+{{ task.title }}))",
    "echo $(( (2 * ({{ task.title }})) ))",
    "echo $(( $(echo 1) + {{ task.title }} ))",
    "echo $[ {{ task.title }} + 1 ]",
    "(( {{ task.title }} > 1 )) && echo big",
    "echo `echo {{ task.title }}`",
    "echo `echo x` `printf %s {{ task.title }}`",
]


@pytest.mark.parametrize("template", ARITHMETIC_AND_BACKQUOTES)
@pytest.mark.parametrize("title", ["$(touch pwned)", "`; touch pwned; `", "a[$(touch pwned)]"])
def test_placeholders_inside_arithmetic_or_backquotes_are_rejected(tmp_path, template, title):
    try:
        command = render(template, {"task": {"title": title}}, shell=True)
    except TemplateError as exc:
        assert "arithmetic" in str(exc) or "backquotes" in str(exc)
    else:
        subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True)
        subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True)
        raise AssertionError(f"rendered {command!r}; ran code: {(tmp_path / 'pwned').exists()}")
    assert not (tmp_path / "pwned").exists()


def test_a_placeholder_after_closed_arithmetic_and_backquotes_is_allowed(tmp_path):
    template = 'echo $(( (1 + 2) * 3 )) $[4] `echo 5` "$((6))" {{ task.title }}'
    command = render(template, {"task": {"title": "$(touch pwned)"}}, shell=True)
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out == "9 4 5 6 $(touch pwned)\n"
    assert not (tmp_path / "pwned").exists()


# --- `run` commands hold references, never task text (render_command) ------------------------------


def run_command(template: str, context: dict, shell: str, cwd) -> bytes:
    command, values = templates.render_command(template, context)
    return subprocess.run([shell, "-c", command], cwd=cwd, env={"PATH": "/usr/bin:/bin", **values},
                          capture_output=True, check=True).stdout


ATTACKS = [
    "echo $'a\\' {{ task.title }}'",  # the finding: \' does not end bash's $'…'
    "echo $'{{ task.title }}'",
    "echo $'a\\\\' {{ task.title }}",  # \\ is one backslash, and the quote after it ends $'…': allowed
    "echo ${{ task.title }}",  # would open $'…' (or $"…") with the value
]


@pytest.mark.parametrize("template", ATTACKS)
@pytest.mark.parametrize("title", ["$(touch pwned)", "'$(touch pwned)'", "\\'; touch pwned; #"])
def test_ansi_c_quotes_and_a_dollar_before_a_placeholder_cannot_run_task_text(tmp_path, template, title):
    context = {"task": {"title": title}}
    for rendered in (lambda: templates.render(template, context, shell=True), lambda: templates.render_command(template, context)[0]):
        try:
            command = rendered()
        except TemplateError as exc:
            assert "$'…'" in str(exc) or "right after a $" in str(exc)
            continue
        for shell in ("sh", "bash"):
            subprocess.run([shell, "-c", command], cwd=tmp_path, capture_output=True, env={"APIARY_T_1": title})
    assert not (tmp_path / "pwned").exists()
    if template == "echo $'a\\\\' {{ task.title }}":
        assert run_command(template, context, "bash", tmp_path) == b"a\\ " + title.encode() + b"\n"


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_placeholder_the_lexer_misjudges_still_runs_no_task_text(tmp_path, monkeypatch, shell):
    """Defence in depth: with every refusal switched off, a placeholder inside
    $'…', double quotes or a here-document is a literal reference or one
    expansion, never shell text that runs."""
    monkeypatch.setattr(templates._QuoteState, "problem", lambda self: None)
    context = {"task": {"title": "$(touch pwned)'`touch pwned`"}}
    for template in ["echo $'a\\' {{ task.title }}'", 'echo "{{ task.title }}"', "cat <<EOF\n{{ task.title }}\nEOF"]:
        command, values = templates.render_command(template, context)
        assert "pwned" not in command
        subprocess.run([shell, "-c", command], cwd=tmp_path, capture_output=True, env=values)
    assert not (tmp_path / "pwned").exists()


ORDINARY = [
    "printf '%s\\0' {{ task.title }} end",
    "printf '[%s]' {{ task.title }}{{ task.title }} x{{ task.title }}y",
    "for w in {{ task.payload.tags }} {{ task.id }}; do printf '<%s>' \"$w\"; done",
    "test -z {{ task.payload.none }} && printf empty",
    "printf '%s|' {{ steps.plan.output }} 'it''s' \"$HOME\" $(( 1 + 2 )) `echo 5`; printf %s {{ task.title }}",
    "x={{ task.title }}; printf '%s' \"$x\" | od -c | head -1 >/dev/null; printf '%s' \"$x\"",
    "cat <<< {{ task.title }}",
]


@pytest.mark.parametrize("template", ORDINARY)
@pytest.mark.parametrize("title", HOSTILE + ["trailing newline\n\n", "ünïcödé ✓", "a\\b"])
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_run_commands_with_references_behave_as_the_quoted_ones(tmp_path, template, title, shell):
    if "<<<" in template and shell == "sh":
        pytest.skip("here-strings are bash's")
    context = {**CONTEXT, "task": {**CONTEXT["task"], "title": title}}
    quoted = templates.render(template, context, shell=True)
    expected = subprocess.run([shell, "-c", quoted], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
                              capture_output=True, check=True).stdout
    assert run_command(template, context, shell, tmp_path) == expected
    command, values = templates.render_command(template, context)
    assert title not in command or title in ("", "*", "-n")
    assert list(values) == [f"APIARY_T_{n}" for n in range(1, len(values) + 1)]
    assert not (tmp_path / "pwned").exists()
