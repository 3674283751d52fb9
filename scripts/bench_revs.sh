#!/usr/bin/env bash
# The train step at another commit against this checkout, in one run: scripts/bench_step.py from each tree in turn,
# ROUNDS times (interleaved, so both see the same machine), then each tree's median step, tokens/s and loss.
#
#   bash scripts/bench_revs.sh REV [bench_step.py arguments...]     # e.g. REV = main~20, a tag, a commit
#
# The other commit is checked out with `git worktree` into a temporary dir and runs with this checkout's venv
# (PY, default .venv/bin/python). Set ROUNDS (default 3). The JSON lines go to OUT (default /tmp/bench_revs.jsonl).
# MFU is not compared: each run measures its own CPU peak, whose noise exceeds the step's (docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: bash scripts/bench_revs.sh REV [bench_step.py arguments...]}"; shift
commit=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "bench_revs: no commit '$rev'" >&2; exit 2; }
PY="${PY:-$PWD/.venv/bin/python}"
ROUNDS="${ROUNDS:-3}"
OUT="${OUT:-/tmp/bench_revs.jsonl}"
other=$(mktemp -d)
trap 'git worktree remove --force "$other" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$other" "$commit"

: > "$OUT"
for round in $(seq "$ROUNDS"); do
  for tree in "$other" "$PWD"; do
    name=$([[ "$tree" == "$PWD" ]] && echo "this checkout" || echo "${commit:0:7}")
    line=$(cd "$tree" && PYTHONPATH="$tree" "$PY" scripts/bench_step.py "$@" 2>/dev/null | tail -n 1)
    [[ "$line" == "{"* ]] || { echo "bench_revs: bench_step failed in $name" >&2; exit 1; }
    "$PY" -c "import json, sys; r = json.loads(sys.argv[1]); r.update(tree=sys.argv[2], round=int(sys.argv[3]))
print(json.dumps(r))" "$line" "$name" "$round" >> "$OUT"
    echo "round $round, $name: $(echo "$line" | "$PY" -c "import json, sys; r = json.load(sys.stdin)
print(f\"{r['step_ms']:.1f} ms, {r['tokens_per_sec']:,.0f} tok/s\")")"
  done
done
"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
medians = {}
for tree in dict.fromkeys(r["tree"] for r in rows):
    mine = [r for r in rows if r["tree"] == tree]
    medians[tree] = statistics.median(r["step_ms"] for r in mine)
    print(f"{tree}: median step {medians[tree]:.1f} ms, {statistics.median(r['tokens_per_sec'] for r in mine):,.0f}"
          f" tok/s, loss {mine[-1]['loss']:.6f}")
other, this = medians.values()
print(f"this checkout / {next(iter(medians))}: {other / this:.3f}x the throughput")
EOF
