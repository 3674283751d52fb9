#!/usr/bin/env bash
# The train step at other commits against this checkout, in one run: scripts/bench_step.py from each tree in turn,
# ROUNDS times (interleaved, so all see the same machine), then each tree's median step, tokens/s and loss, and this
# checkout's throughput over each baseline's.
#
#   bash scripts/bench_revs.sh REV[,REV...] [bench_step.py arguments...]   # e.g. efc6d56,main~20 (a tag, a commit)
#
# Each other commit is checked out with `git worktree` into a temporary dir and runs with this checkout's venv
# (PY, default .venv/bin/python). Set ROUNDS (default 3). The JSON lines go to OUT (default /tmp/bench_revs.jsonl).
# MFU is not compared: each run measures its own CPU peak, whose noise exceeds the step's (docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/.."
revs="${1:?usage: bash scripts/bench_revs.sh REV[,REV...] [bench_step.py arguments...]}"; shift
PY="${PY:-$PWD/.venv/bin/python}"
ROUNDS="${ROUNDS:-3}"
OUT="${OUT:-/tmp/bench_revs.jsonl}"
others=() names=()
# The baselines' worktrees are removed on exit (only they: this checkout may itself be a worktree).
trap 'for t in "${others[@]}"; do git worktree remove --force "$t" >/dev/null 2>&1 || true; done' EXIT
for rev in ${revs//,/ }; do
  commit=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "bench_revs: no commit '$rev'" >&2; exit 2; }
  others+=("$(mktemp -d)") names+=("${commit:0:7}")
  git worktree add -q --detach "${others[-1]}" "$commit"
done
trees=("${others[@]}" "$PWD") names+=("this checkout")

: > "$OUT"
for round in $(seq "$ROUNDS"); do
  for i in "${!trees[@]}"; do
    tree=${trees[$i]} name=${names[$i]}
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
this = medians.pop("this checkout")
for tree, other in medians.items():
    print(f"this checkout / {tree}: {other / this:.3f}x the throughput")
EOF
