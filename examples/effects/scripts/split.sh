#!/bin/sh
# The spawn step: one JSON object per line, {"id", "title", "body"?, "payload"?, "workflows"?}.
# Apiary records the list once; each child becomes a task of this task's source,
# key <parent item key>/<workflow>/<step>/<id>, run by its `workflows`.
set -eu
echo '{"id": "changelog", "title": "Write the changelog", "workflows": ["chore"]}'
echo '{"id": "announce", "title": "Announce the release", "body": "Post it on the blog.", "workflows": ["chore"]}'
