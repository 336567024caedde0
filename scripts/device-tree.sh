#!/usr/bin/env bash
# The device tool copies the tracked tree with every call and counts it against the call's 64 MiB;
# the committed drafter is 38.7 MB of it. `slim` takes the drafter out of the index (the files stay
# on disk, ignored through .git/info/exclude) so that a call can carry a GGUF part; `restore` puts
# it back. Commit only after `restore` (or commit with explicit paths). `size` prints the tracked bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
D=drafters/smollm2-135m-instruct
X=.git/info/exclude
case ${1:-size} in
slim)
  git rm -r -q --cached --ignore-unmatch $D
  grep -qxF "/$D/" $X 2>/dev/null || echo "/$D/" >> $X
  ;;
restore)
  git reset -q HEAD -- $D
  [ -f $X ] && sed -i "\#^/$D/\$#d" $X
  ;;
size) ;;
*) echo "usage: $0 slim|restore|size" >&2; exit 2 ;;
esac
echo "tracked: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
