#!/bin/sh
# The publish step: an external write (here a file in out/releases/, in life an
# API call, a tag, a pull request), keyed by APIARY_EFFECT_KEY. Apiary records
# its success once and never runs it again after that; it runs it a second time,
# with the same key and APIARY_EFFECT_RETRY=1, only when a first run's end is
# unknown (its worker died mid-command), and then the key finds the first write.
set -eu
out="$(dirname "$APIARY_CONFIG")/out"
mkdir -p "$out/releases"
release="$out/releases/$APIARY_EFFECT_KEY"
if [ -f "$release" ]; then
    cat "$release"  # the first run got there: report it, publish nothing new
    exit 0
fi
url="https://releases.example.invalid/$APIARY_EFFECT_KEY"
printf '%s %s retry=%s\n' "$APIARY_TASK_ITEM_KEY" "$APIARY_EFFECT_KEY" "${APIARY_EFFECT_RETRY:-0}" >> "$out/published.log"
printf '%s' "$url" > "$release.tmp" && mv "$release.tmp" "$release"
printf '%s' "$url"
