#!/usr/bin/env bash
# Compares a benchmark between two revisions on a noisy machine.
#
#   scripts/ab-compare.sh BASE_REV ROUNDS BIN [ARGS...]
#   scripts/ab-compare.sh HEAD~1 12 hg-perf rate --mode busy --sizes 0 --inflight 1,16 --batches 5
#   scripts/ab-compare.sh --pgo 12 hg-perf rate --mode busy --sizes 0 --inflight 1,16 --batches 5
#
# With --pgo in place of BASE_REV, base is the working tree's plain release
# build and new its profile-guided build (scripts/pgo-build.sh).
#
# BASE_REV is built in a git worktree (target/ab-base, its own target
# directory), the working tree as it is in target/release. Each round runs
# BIN from both builds back to back, in alternating order (so neither
# always runs first), with --json. Printed per figure: each build's median,
# and the median and range of the per-round ratios new/base with how many
# rounds new won. On this 2-core VM one series of runs drifts by 5-10 %
# over minutes; rounds compare two runs made seconds apart, so a change is
# real when the ratio median and the win count agree (say 10 of 12), not
# when the two medians differ by a few percent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { sed -n '4,6p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
base=$1 rounds=$2 bin=$3
shift 3
command -v python3 >/dev/null || { echo "ab-compare: needs python3" >&2; exit 2; }

pkgs=(-p na-perf -p hg-rpc)
if [ "$base" = --pgo ]; then
  echo "building the working tree, plain and profile-guided..." >&2
  cargo build --quiet --release "${pkgs[@]}"
  base_bin=${CARGO_TARGET_DIR:-$PWD/target}/release/$bin
  new_bin=$(bash scripts/pgo-build.sh)/$bin
else
  wt=target/ab-base
  rev=$(git rev-parse --verify "$base^{commit}")
  if [ ! -d "$wt" ]; then
    git worktree add --detach "$wt" "$rev" >/dev/null
  else
    git -C "$wt" checkout --quiet --detach "$rev"
  fi
  new_dir=${CARGO_TARGET_DIR:-$PWD/target}
  base_dir=$PWD/target/ab-base-target
  echo "building base $rev and the working tree..." >&2
  (cd "$wt" && CARGO_TARGET_DIR=$base_dir cargo build --quiet --release "${pkgs[@]}")
  CARGO_TARGET_DIR=$new_dir cargo build --quiet --release "${pkgs[@]}"
  base_bin=$base_dir/release/$bin
  new_bin=$new_dir/release/$bin
fi

out=$(mktemp)
trap 'rm -f "$out"' EXIT
for i in $(seq "$rounds"); do
  if [ $((i % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for v in $order; do
    b=$base_bin
    [ "$v" = new ] && b=$new_bin
    "$b" "$@" --json 2>/dev/null | sed "s/^/$i $v /" >>"$out"
  done
  echo "round $i/$rounds done" >&2
done

python3 - "$out" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    rnd, v, j = line.split(' ', 2)
    try:
        r = json.loads(j)
    except ValueError:
        continue
    key = tuple(r.get(k) for k in ('test', 'op', 'mode', 'size', 'inflight', 'segments'))
    runs.setdefault(key, {}).setdefault(rnd, {})[v] = (r['median'], r.get('unit', ''))
for key, rounds in sorted(runs.items(), key=lambda kv: str(kv[0])):
    pairs = [(d['base'][0], d['new'][0]) for d in rounds.values() if 'base' in d and 'new' in d]
    if not pairs:
        continue
    unit = next(iter(rounds.values()))['base'][1] if 'base' in next(iter(rounds.values())) else ''
    higher_is_better = unit not in ('ns', 'us')
    ratios = sorted(n / b for b, n in pairs if b)
    wins = sum(1 for b, n in pairs if (n > b) == higher_is_better and n != b)
    name = ' '.join(str(k) for k in key if k is not None)
    print('%-40s base %12.1f  new %12.1f %-6s  new/base median %.3f (%.3f..%.3f), new better in %d/%d' % (
        name, statistics.median(b for b, _ in pairs), statistics.median(n for _, n in pairs), unit,
        ratios[len(ratios) // 2], ratios[0], ratios[-1], wins, len(pairs)))
PY
