#!/bin/sh
# A spawned child's workflow: note the child task's key in out/chores.log.
set -eu
out="$(dirname "$APIARY_CONFIG")/out"
mkdir -p "$out"
printf '%s\n' "$APIARY_TASK_ITEM_KEY" >> "$out/chores.log"
echo "did: $APIARY_TASK_TITLE"
