"""The one way Apiary parses YAML: apiary.yaml and a task file's front matter.

`load` is `yaml.safe_load` with three refusals:

* **anchors and aliases** (`&name`, `*name`): an alias is a reference, and a
  few hundred bytes of nested references ("billion laughs") expand to
  gigabytes and minutes of CPU. Neither apiary.yaml nor front matter needs
  them; write the value again instead. (A merge key with an inline mapping,
  `<<: {a: 1}`, still works: it references nothing.)
* **nesting deeper than `MAX_DEPTH`** levels of mappings and sequences: the
  composer recurses once per level, and the result becomes JSON with the same
  bound (jobqueue.jsonlimits).
* **duplicate mapping keys**: plain safe_load keeps the last one silently,
  which would hide a whole agent, setting or task field.

Every refusal is a `yaml.YAMLError` with a mark, so `problem()` names its
line and column like any other YAML error. Callers cap the size of the text
before they call `load` (CONFIG_CAP in workflows/config/loading.py,
FRONT_MATTER_CAP in workflows/sources.py).
"""

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

from jobqueue.jsonlimits import MAX_DEPTH


class _Loader(yaml.SafeLoader):
    """SafeLoader without anchors, aliases, deep nesting or duplicate keys."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise ComposerError(
                None, None, f"alias *{event.anchor} refused: YAML aliases are not accepted (write the value out)",
                event.start_mark,
            )
        if getattr(event, "anchor", None) is not None:
            raise ComposerError(
                None, None, f"anchor &{event.anchor} refused: YAML anchors and aliases are not accepted",
                event.start_mark,
            )
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: {…}` may be overridden by explicit keys; that is not a duplicate
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable key: construct_mapping reports it properly
        if duplicate:
            raise ConstructorError("while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(text: str) -> Any:
    """Parse one YAML document; a yaml.YAMLError (see `problem`) for invalid
    YAML, an anchor or alias, nesting deeper than MAX_DEPTH, a duplicate key."""
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: as safe as yaml.safe_load
    except RecursionError:  # not reached through the composer's bound; kept as a backstop
        raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels") from None


def problem(exc: yaml.YAMLError, *, line_offset: int = 0) -> str:
    """`line L, column C: invalid YAML: …` (the line counted from 1, plus
    `line_offset` when the YAML started further down a file)."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1 + line_offset}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}invalid YAML: {what}"
