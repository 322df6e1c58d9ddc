#!/usr/bin/env python3
"""The layout of the busy RPC path, counted by callgrind on hg-perf itself.

    scripts/hot-path-profile.py [--bin PATH] [--jumps REGEX] [--keep DIR]

Runs `hg-perf rate --mode busy --sizes 0 --inflight 1` (client and the
server it starts, both under `valgrind --tool=callgrind --collect-jumps=yes
--dump-instr=yes`) and prints, for each process, per call (per send of the
sm plugin, one a call on each side), leaving out the spin loop (whose
count is the time spent waiting, not work):

  * instructions executed;
  * jumps taken (conditional and unconditional): each one a break in the
    front end's fetch;
  * hot code: the 64-byte lines and 4 KiB pages holding instructions that
    run on (nearly) every call;
  * the functions with the most of either (the first 14; HPP_TOP=N for
    more).

With --jumps REGEX, it also lists every jump taken on at least every
other call in the functions whose name matches, with the source line
(addr2line, through inlining) it belongs to: where the compiler's layout
makes the common path jump. Unlike `busy-path-cost.sh` (one process,
deterministic) it measures the real binary, whose inlining differs; the
counts per call are stable to a few percent across runs. Compare a
profile-guided build with `--bin target/pgo/<host>/release/hg-perf`
(docs/PERFORMANCE.md, session 38).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

NORM = r"SmPlugin as na_core::plugin::Plugin>::send_unexpected_parts$"
SPIN = "spin_wait"
POS = re.compile(r"^(c?fi|fe|fl|c?ob|jfi|jfe|cfl)=")
FN = re.compile(r"c?fn=\((\d+)\)(?: (.*))?")


def position(tok, last):
    """An instruction address of callgrind's compressed format."""
    if tok == "*":
        return last
    if tok[0] == "+":
        return last + int(tok[1:], 0)
    if tok[0] == "-":
        return last - int(tok[1:], 0)
    return int(tok, 0)


def parse(path):
    """Per function: self cost, jumps taken; calls made to each function;
    per instruction: its count; the taken jumps by source instruction."""
    names, cur, callee, last = {}, None, None, 0
    cost = collections.Counter()
    taken = collections.Counter()
    calls = collections.Counter()
    instr = {}
    jumps = []
    skip_call_cost = False
    pending_jump = None
    with open(path) as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                m = FN.match(line.strip())
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                if line[0] == "f":
                    cur = names.get(m.group(1), m.group(1))
                else:
                    callee = names.get(m.group(1))
                continue
            if POS.match(line):
                continue
            if line.startswith("calls="):
                calls[callee] += int(line[6:].split()[0])
                skip_call_cost = True
                continue
            if line.startswith(("jcnd=", "jump=")):
                rest = line[5:].split()
                if line[0:4] == "jcnd":
                    n, executed = map(int, rest[0].split("/"))
                else:
                    n = executed = int(rest[0])
                taken[cur] += n
                pending_jump = (n, executed, position(rest[1], last))
                continue
            if line[:1] in "0123456789+-*":
                parts = line.split()
                last = position(parts[0], last)
                if pending_jump is not None:
                    jumps.append((cur, last) + pending_jump)
                    pending_jump = None
                if skip_call_cost:
                    skip_call_cost = False
                    continue
                if len(parts) >= 3:
                    cost[cur] += int(parts[2])
                    instr[(cur, last)] = instr.get((cur, last), 0) + int(parts[2])
    return cost, taken, calls, instr, jumps


def short(name):
    name = re.sub(r"<impl [^>]*>", "", name or "?")
    return name.replace("<na_sm::plugin::SmPlugin as na_core::plugin::Plugin>", "Sm")[-72:]


def sources(binary, addrs):
    """addr2line's inlining chain of each address, innermost first."""
    if not addrs:
        return {}
    out = subprocess.run(
        ["addr2line", "-e", binary, "-i", "-a"] + [hex(a) for a in addrs],
        capture_output=True, text=True, check=False,
    ).stdout
    chains, cur = {}, None
    for line in out.splitlines():
        if line.startswith("0x"):
            cur = int(line, 16)
            chains[cur] = []
        elif cur is not None:
            chains[cur].append(re.sub(r"^.*/(crates|library)/", "", line))
    return chains


def report(path, binary, jumps_re):
    cost, taken, calls, instr, jumps = parse(path)
    n = sum(v for k, v in calls.items() if k and re.search(NORM, k))
    if n == 0:
        return False
    work = [k for k in cost if SPIN not in (k or "")]
    hot = {a for (fn, a), c in instr.items() if c >= 0.9 * n and SPIN not in (fn or "")}
    lines = {a // 64 for a in hot}
    print(f"{os.path.basename(path)}: {n} calls; per call, leaving out the spin loop:")
    print(f"  instructions {sum(cost[k] for k in work) / n:.0f}, jumps taken "
          f"{sum(taken[k] for k in work) / n:.1f}, hot code {len(lines)} lines of 64 B "
          f"in {len({l * 64 // 4096 for l in lines})} pages")
    rows = sorted(work, key=lambda k: -(taken[k] + cost[k] / 50))
    for k in rows[:int(os.environ.get("HPP_TOP", "14"))]:
        if cost[k] / n >= 3:
            print(f"    {short(k):72} {cost[k] / n:6.0f} instr {taken[k] / n:5.1f} taken")
    if jumps_re:
        sel = [j for j in jumps if j[0] and re.search(jumps_re, j[0]) and j[2] >= 0.5 * n]
        chains = sources(binary, sorted({j[1] for j in sel}))
        for fn, at, k, executed, target in sorted(sel, key=lambda j: j[1]):
            where = " <- ".join(chains.get(at, [])[:3])
            print(f"    {at:x} taken {k / n:.2f} of {executed / n:.2f} -> {target:x}  {where}")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/hg-perf")
    ap.add_argument("--jumps", help="list the taken jumps of functions matching this regex")
    ap.add_argument("--keep", help="keep callgrind's files in this directory")
    a = ap.parse_args()
    if subprocess.run(["sh", "-c", "command -v valgrind addr2line"], capture_output=True).returncode:
        sys.exit("hot-path-profile: needs valgrind and addr2line (apt-get install valgrind binutils)")
    out = a.keep or tempfile.mkdtemp(prefix="hot-path-")
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "cg.*")):
        os.remove(old)
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--trace-children=yes", "--collect-jumps=yes",
         "--dump-instr=yes", f"--callgrind-out-file={out}/cg.%p", a.bin, "rate", "--mode", "busy",
         "--sizes", "0", "--inflight", "1", "--batches", "2", "--batch-ms", "1500"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if run.returncode != 0:
        sys.exit(f"hot-path-profile: hg-perf failed under valgrind:\n{run.stderr[-2000:]}")
    found = [report(p, a.bin, a.jumps) for p in sorted(glob.glob(os.path.join(out, "cg.*")))]
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    if not any(found):
        sys.exit("hot-path-profile: no process made a send (did the run fail?)")


if __name__ == "__main__":
    main()
