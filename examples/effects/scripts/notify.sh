#!/bin/sh
# A hook: runs once per instance outcome, as a job of its own, with
# APIARY_HOOK_OUTCOME and APIARY_EFFECT_KEY (the same for every attempt of this hook).
set -eu
out="$(dirname "$APIARY_CONFIG")/out"
mkdir -p "$out"
printf '%s %s %s %s\n' "$APIARY_TASK_ITEM_KEY" "$1" "$APIARY_HOOK_OUTCOME" "$APIARY_EFFECT_KEY" >> "$out/notified.log"
