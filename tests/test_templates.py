import subprocess

import pytest

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
