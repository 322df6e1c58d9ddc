#!/usr/bin/env bash
# Mercury's own RPC rate and ours, in the same minutes: the host's phase
# (this 2-core VM runs 2-3x slower for minutes at a time) moves both, so
# the ratio of the two, round by round, is the figure to compare.
#
#   scripts/mercury-compare.sh MERCURY_SRC ROUNDS [HG_PERF...]
#   scripts/mercury-compare.sh ~/src/mercury 12
#   scripts/mercury-compare.sh ~/src/mercury 12 target/release/hg-perf target/pgo/x86_64-unknown-linux-gnu/release/hg-perf
#
# MERCURY_SRC is a checkout of github.com/mercury-hpc/mercury (not
# fetched here: CI has no network beyond the package mirrors, so this is a
# manual benchmark, as in docs/PERFORMANCE.md). It is built once, Release,
# with only its sm plugin and its perf tools, into target/mercury-build
# (needs cmake and a C compiler). Each round runs, alternating the order:
# Mercury's hg_perf_server and hg_rate (busy, 0 B, 1 and then 16 handles in
# flight, LOOPS calls each (environment, default 500000), a fresh server
# per run), and each HG_PERF binary's `rate --mode busy --sizes 0
# --inflight 1,16` (default: the working tree's release build). Server on
# CPU 0, client on CPU 1, both tools. Printed: per figure and binary the
# median and best, the median and range of the per-round ratios to
# Mercury, and each round's figures (the raw lines are kept in a temporary
# file whose path is printed last).
set -euo pipefail
[ $# -ge 2 ] || { sed -n '6,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
# Paths are the caller's: made absolute before the move to the tree's root.
src=$(CDPATH='' cd -- "$1" && pwd) || { echo "mercury-compare: no directory $1" >&2; exit 2; }
rounds=$2
shift 2
bins=()
for b in "$@"; do
  [ -x "$b" ] || { echo "mercury-compare: $b is not an executable" >&2; exit 2; }
  bins+=("$(CDPATH='' cd -- "$(dirname -- "$b")" && pwd)/$(basename -- "$b")")
done
cd "$(dirname "$0")/.."
loops=${LOOPS:-500000}
for t in cmake cc python3 taskset timeout; do
  command -v "$t" >/dev/null || { echo "mercury-compare: needs $t" >&2; exit 2; }
done
[ -f "$src/Testing/perf/hg/hg_rate.c" ] || { echo "mercury-compare: $src is not a Mercury source tree" >&2; exit 2; }
if [ ${#bins[@]} -eq 0 ]; then
  # Only the default binary is built here: one given may be a special build.
  cargo build --quiet --release -p hg-rpc --bin hg-perf
  bins=("$PWD/target/release/hg-perf")
fi

# Built again when the source (its path or its commit) is another.
build=$PWD/target/mercury-build
stamp="$src $(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)"
if [ ! -x "$build/bin/hg_rate" ] || [ "$(cat "$build/.source" 2>/dev/null)" != "$stamp" ]; then
  echo "building Mercury from $src into $build..." >&2
  rm -rf "$build"
  mkdir -p "$build"
  { cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=ON \
      -DBUILD_TESTING_UNIT=OFF -DBUILD_TESTING_PERF=ON -DNA_USE_SM=ON &&
    cmake --build "$build" -j "$(nproc)"; } >"$build/build.log" 2>&1 ||
    { echo "mercury-compare: the Mercury build failed; see $build/build.log" >&2; exit 1; }
  echo "$stamp" >"$build/.source"
fi

out=$(mktemp)
run_dir='' server=''
# An interrupted run leaves no busy-waiting server behind.
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  if [ -n "$run_dir" ]; then rm -rf "$run_dir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# One Mercury run: a fresh server (it exits when the client is done), the
# client's rate for 0 B, read from the column its header names "Rate".
# Prints the rate, or "nan" if the run failed.
mercury_rate() {
  run_dir=$(mktemp -d)
  (cd "$run_dir" && exec taskset -c 0 "$build/bin/hg_perf_server" -c na -p sm -b \
    >server.log 2>&1 </dev/null) &
  server=$!
  for _ in $(seq 50); do [ -s "$run_dir/port.cfg" ] && break; sleep 0.1; done
  (cd "$run_dir" && timeout 60 taskset -c 1 "$build/bin/hg_rate" -c na -p sm -b -y 0 -z 1 \
    -x "$1" -l "$loops" 2>/dev/null || true) | awk '
    /^# *Size/ { n = split($0, h, /  +/); for (i = 1; i <= n; i++) if (h[i] ~ /Rate/) col = i }
    $1 == "0" && NF >= 2 && !found { print $(col ? col : 2); found = 1 }
    END { if (!found) print "nan" }'
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  server=''
  rm -rf "$run_dir"
  run_dir=''
}

# Lines: round <TAB> who <TAB> in flight <TAB> rate (nan: the run failed).
for i in $(seq "$rounds"); do
  order=("${bins[@]}")
  if [ $((i % 2)) = 0 ]; then
    order=()
    for ((k = ${#bins[@]} - 1; k >= 0; k--)); do order+=("${bins[k]}"); done
    order+=(mercury)
  else
    order=(mercury "${order[@]}")
  fi
  for r in "${order[@]}"; do
    if [ "$r" = mercury ]; then
      for n in 1 16; do printf '%s\tmercury\t%s\t%s\n' "$i" "$n" "$(mercury_rate "$n")" >>"$out"; done
    else
      { "$r" rate --mode busy --sizes 0 --inflight 1,16 --cpu 1,0 --json 2>/dev/null || true; } |
        python3 -c 'import json, sys
got = {}
for l in sys.stdin:
    try:
        o = json.loads(l)
    except ValueError:
        continue
    got[o["inflight"]] = o["median"]
for n in (1, 16):
    print(sys.argv[1], sys.argv[2], n, got.get(n, float("nan")), sep="\t")' "$i" "$r" >>"$out"
    fi
  done
  echo "round $i/$rounds done" >&2
done

python3 - "$out" <<'PY'
import math, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    rnd, who, n, v = line.rstrip('\n').split('\t')
    rows.setdefault((int(n), who), {})[rnd] = float(v)
ok = lambda v: not math.isnan(v) and v > 0
for n in (1, 16):
    merc = {r: v for r, v in rows.get((n, 'mercury'), {}).items() if ok(v)}
    if not merc:
        print(f'{n} in flight: every Mercury run failed')
        continue
    print(f'{n} in flight: mercury median {statistics.median(merc.values())/1e6:.2f}M '
          f'best {max(merc.values())/1e6:.2f}M ({len(merc)} runs)')
    ours = {who: {r: v for r, v in vals.items() if ok(v)}
            for (m, who), vals in sorted(rows.items()) if m == n and who != 'mercury'}
    for who, vals in ours.items():
        if not vals:
            print(f'  {who}: every run failed')
            continue
        line = f'  {who}: median {statistics.median(vals.values())/1e6:.2f}M best {max(vals.values())/1e6:.2f}M'
        ratios = sorted(v / merc[r] for r, v in vals.items() if r in merc)
        if ratios:
            line += f'; /mercury per round median {statistics.median(ratios):.2f} ({ratios[0]:.2f}..{ratios[-1]:.2f})'
        print(line)
    for rnd in sorted(set(merc) | {r for v in ours.values() for r in v}, key=int):
        cells = [f'{merc[rnd]/1e6:.2f}M' if rnd in merc else 'failed']
        cells += [f'{v[rnd]/1e6:.2f}M' if rnd in v else 'failed' for v in ours.values()]
        print(f'    round {rnd}: mercury ' + ' '.join(cells))
PY
echo "raw figures: $out" >&2
