"""The figures of docs/BENCHMARKS.md, "Two GPUs (issue 11)", printed from the raw results.

    python3 bench/gpu/two_gpu_table.py bench/gpu/results/h200x2-2026-11-30

Reads runN/results.json and runN/nccl-debug.log of every run folder (bench/gpu/two_gpu.py wrote
them) and prints one markdown table per experiment; nothing here is measured again.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ORDER = ["defaults", "P", "S", "C", "SC", "PC", "PS", "PSC", "PSH"]
SIZES = [(64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB"), (256 << 20, "256 MiB"), (1 << 30, "1 GiB")]


def env_of(rec: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in rec.get("env", {}).items()) or "(NCCL's defaults)"


def transports(run: Path) -> dict[str, str]:
    out: dict[str, set[str]] = {}
    cur = ""
    for ln in (run / "nccl-debug.log").read_text(errors="replace").splitlines():
        if ln.startswith("====="):
            cur = ln.split()[1].removeprefix("bisect-")
            out.setdefault(cur, set())
        elif (m := re.search(r" via (\S+)", ln)) and cur:
            out[cur].add(m.group(1))
    return {k: ", ".join(sorted(v)) for k, v in out.items()}


def busbw(rows: Any, size: int) -> float | None:
    try:
        return float(next(r["busbw_GBps"] for r in rows[0] if r["bytes"] == size))
    except (StopIteration, KeyError, IndexError, TypeError):
        return None


def resume_word(rec: dict[str, Any]) -> str:
    if "resume" not in rec:
        return "not run"
    r = rec["resume"]
    if r["rc"] == 0:
        return "ok" if rec.get("capturable") else "resumed, checks failed"
    errs = sorted({j["error"].removeprefix("restore ") for j in r["json"] if j.get("error")})
    return "failed: " + "; ".join(errs)


def bisect(runs: list[tuple[str, dict[str, Any], Path]]) -> None:
    print("| NCCL settings | transport (NCCL_DEBUG=INFO) | save | resume "
          "| busbw GB/s 64 KiB / 1 MiB / 16 MiB / 256 MiB |")
    print("| --- | --- | --- | --- | --- |")
    recs = {name: {**r.get("bisect", {}).get("combos", {}), "defaults": r.get("defaults", {})} for name, r, _ in runs}
    trs = {name: transports(path) for name, _, path in runs}
    for c in ORDER:
        per = [(name, recs[name].get(c)) for name, _, _ in runs if recs[name].get(c)]
        if not per:
            continue
        first = per[0][1]
        save = " / ".join("ok" if rec["save"]["rc"] == 0 else f"rc {rec['save']['rc']}" for _, rec in per)
        res = " / ".join(resume_word(rec) for _, rec in per)
        bws = [busbw(first.get("bw_before"), s) for s, _ in SIZES[:4]]
        bw = " / ".join(f"{b:.1f}" if b is not None else "-" for b in bws)
        print(f"| {env_of(first)} | {trs[per[0][0]].get(c, '?')} | {save} | {res} | {bw} |")


def bwcmp(r: dict[str, Any]) -> None:
    combos = r["bwcmp"]["combos"]
    print("| NCCL settings | " + " | ".join(label for _, label in SIZES) + " |")
    print("| --- |" + " --- |" * len(SIZES))
    base: dict[int, float] = {}
    for c in ("defaults", "PC", "PS", "PSC"):
        rounds = combos[c]["rounds"]
        cells = []
        for size, _ in SIZES:
            vals = [b for rnd in rounds if (b := busbw(rnd, size)) is not None]
            med = statistics.median(vals)
            base.setdefault(size, med)
            ratio = "" if c == "defaults" else f" ({med / base[size]:.2f}x)"
            cells.append(f"{med:.1f} ({min(vals):.1f}-{max(vals):.1f}){ratio}")
        print(f"| {env_of(combos[c])} | " + " | ".join(cells) + " |")


def recover(runs: list[tuple[str, dict[str, Any], Path]]) -> None:
    print("| step | driver's answer, " + " / ".join(n for n, _, _ in runs) + " | states after |")
    print("| --- | --- | --- |")
    first = runs[0][1]["defaults"]
    errs = sorted({j["error"] for j in first["resume"]["json"] if j.get("error")})
    print(f"| `resume` of both right after `save` | {'; '.join(errs)} | both checkpointed |")
    steps = [r["recover"]["steps"] for _, r, _ in runs]
    for i, s in enumerate(steps[0]):
        answers = []
        for st in steps:
            cli = st[i].get("cli")
            answers.append("; ".join(sorted({j["error"] for j in cli["json"] if j.get("error")})) if cli else "-")
        states = ", ".join(sorted(set(s["states"].values()))) if s.get("states") else "-"
        print(f"| {s['step']} | {' / '.join(answers)} | {states} |")
    for _, r, _ in runs:
        o = r["recover"]["one_rank_alone"]
        print(f"| second default pair: `save` of rank 1 alone, rank 0 running | save rc {o['save_rank1']['rc']}, then "
              f"resume: {o['resume_rank1']['stderr'].split(': ', 1)[-1]} | "
              f"{', '.join(f'{v}' for v in o['after_resume']['states'].values())} |")


def loop(r: dict[str, Any]) -> None:
    lp = r["loop"]
    print(f"NCCL settings: {env_of(lp)}; ranks of {lp['mib'][0]} and {lp['mib'][1]} MiB; "
          f"all 10 cycles ok: {lp['all_ok']}")
    print()
    print("| cycle | mode | save s | resume s | checkpoint ms (rank 0 / 1) | restore ms (rank 0 / 1) | "
          "GPU MiB used before → saved (GPU 0, GPU 1) | after: all-reduce, pattern |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in lp["cycles"]:
        ck = " / ".join(f"{j['ms']['checkpoint']:.0f}" for j in c["save"]["json"])
        rs = " / ".join(f"{j['ms']['restore']:.0f}" for j in c["resume"]["json"])
        before = ", ".join(str(g["used_mib"]) for g in c["smi_before"]["gpus"])
        saved = ", ".join(str(g["used_mib"]) for g in c["smi_saved"]["gpus"])
        ok = "ok" if all(o.startswith("ok") for o in c["ar_after"] + c["check_after"]) else "BAD"
        print(f"| {c['cycle']} | {c['mode']} | {c['save']['wall_s']:.2f} | {c['resume']['wall_s']:.2f} | {ck} | {rs} | "
              f"{before} → {saved} | {ok} |")
    for mode in ("overlapped", "serial"):
        cs = [c for c in lp["cycles"] if c["mode"] == mode]
        sv, rs = [c["save"]["wall_s"] for c in cs], [c["resume"]["wall_s"] for c in cs]
        print(f"\n{mode}: save median {statistics.median(sv):.2f} s ({min(sv):.2f}-{max(sv):.2f}), resume median "
              f"{statistics.median(rs):.2f} s ({min(rs):.2f}-{max(rs):.2f}), n={len(cs)}")


def swap(r: dict[str, Any]) -> None:
    print("| round | placement before (rank: GPU, MiB) | `resume --gpu-map 0=1,1=0` | placement after | GPU MiB used "
          "(GPU 0, GPU 1) before → saved → after | pattern + new work | all-reduce | busbw 16 / 256 MiB after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rnd in ("away", "home"):
        v = r["swap"][rnd]

        def pl(p: list[dict[str, Any]]) -> str:
            return ", ".join(f"{x['rank']}: GPU {x['gpus'][0]} {x['used_mib'][0]}" for x in p)

        used = " → ".join(", ".join(str(g["used_mib"]) for g in v[k]["gpus"])
                          for k in ("smi_before", "smi_saved", "smi_after"))
        bw = json.loads(v["bw"][0])
        print(f"| {rnd} | {pl(v['placement_before'])} | rc {v['resume']['rc']}, {v['resume']['wall_s']:.2f} s | "
              f"{pl(v['placement_after'])} | {used} | {', '.join(v['check'])} | {', '.join(v['ar'])} | "
              f"{bw[0]['busbw_GBps']:.1f} / {bw[1]['busbw_GBps']:.1f} |")


def busy(r: dict[str, Any]) -> None:
    b = r["busy"]
    for k, what in (("one_rank_inside", "rank 0 inside a 64 MiB all-reduce rank 1 has not entered"),
                    ("both_in_a_queue", "both ranks in a queue of 1 GiB all-reduces")):
        v = b[k]
        s = v["save"]
        ms = "; ".join(", ".join(f"{op} {t:.1f} ms" for op, t in j["ms"].items()) for j in s["json"])
        print(f"- {what}: `{s['cmd']}` exit {s['rc']} after {s['wall_s']:.2f} s"
              f"{': ' + s['stderr'] if s['stderr'] else ''}; per rank: {ms}; states after: "
              f"{', '.join(v['states'].values())}; the collective then: {', '.join(v['wait'])}; a new all-reduce: "
              f"{', '.join(v['ar'])}")


def criu(runs: list[tuple[str, dict[str, Any], Path]]) -> None:
    print("| run | ranks' settings | dump | restore | after |")
    print("| --- | --- | --- | --- | --- |")
    for name, r, path in runs:
        c = r.get("criu")
        if not isinstance(c, dict):
            continue
        variants = {"": c} if "dump" in c else {k: v for k, v in c.items() if isinstance(v, dict)}
        log = (path / "criu.log").read_text(errors="replace") if (path / "criu.log").exists() else ""
        errors = [ln.split("Error ", 1)[1] for ln in log.splitlines()
                  if "Error (" in ln and "RLIMIT" not in ln and "restore tid" not in ln and "FAILED" not in ln]
        for vname, v in variants.items():
            if "dump" not in v:
                print(f"| {name} {vname} | {env_of(v)} | not tried: io_uring per process {v.get('io_uring')} | | |")
                continue
            d = v["dump"]
            dump = f"rc {d['rc']}, {d['s']:.1f} s"
            rest = "-"
            if "restore" in v:
                rest = f"rc {v['restore']['rc']}, {v['restore']['s']:.2f} s"
                if "restore_retry_65s" in v:
                    rr = v["restore_retry_65s"]
                    rest += f"; 65 s later: rc {rr['rc']}, {rr['s']:.2f} s"
            after = ""
            if v.get("ok") is not None:
                used = " → ".join(", ".join(str(g["used_mib"]) for g in v[k]["gpus"])
                                  for k in ("smi_before", "smi_dumped", "smi_restored"))
                after = (f"{', '.join(v['ar_after'])}; {', '.join(v['check_after'])}; GPU MiB {used}; images "
                         f"{v['images']['bytes'] / 1e9:.1f} GB")
            print(f"| {name} {vname} | {env_of(v)} | {dump} | {rest} | {after} |")
        for e in dict.fromkeys(errors):
            print(f"|  | CRIU: {e.strip()} | | | |")


def main() -> None:
    root = Path(sys.argv[1])
    runs = [(p.name, json.loads((p / "results.json").read_text()), p) for p in sorted(root.glob("run*"))]
    with_bisect = [x for x in runs if "bisect" in x[1]]
    sections = [("bisect", lambda: bisect(with_bisect)), ("bandwidth", lambda: bwcmp(next(r for _, r, _ in runs
                                                                                         if "bwcmp" in r))),
                ("recovery", lambda: recover([x for x in runs if "recover" in x[1]])),
                ("loop", lambda: loop(next(r for _, r, _ in runs if "loop" in r))),
                ("swap", lambda: swap(next(r for _, r, _ in runs if "swap" in r))),
                ("busy", lambda: busy(next(r for _, r, _ in runs if "busy" in r))),
                ("criu", lambda: criu(runs))]
    for title, fn in sections:
        print(f"\n### {title}\n")
        fn()
    for name, r, _ in runs:
        if isinstance(r.get("pytest"), dict) and r["pytest"].get("summary"):
            print(f"\npytest ({name}): {r['pytest']['summary'][-1].strip('= ')}")


if __name__ == "__main__":
    main()
