#!/usr/bin/env python3
"""Prints the demo's loss table and draws demo/out/loss.png.

Usage: report.py OUTDIR SAVE_STEP
Reads OUTDIR/{full_dp4,save_dp4,resume_dp2,resume_dp8}.json (losses per step, rank 0) and
OUTDIR/refusal.txt (the framework's error when resuming at 2 ranks without ucp).
"""
import json
import os
import sys


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return {int(step): loss for step, loss in data["losses"].items()}


def main():
    out, save_step = sys.argv[1], int(sys.argv[2])
    full = load(os.path.join(out, "full_dp4.json"))
    saved = load(os.path.join(out, "save_dp4.json"))
    resumes = {n: load(os.path.join(out, f"resume_dp{n}.json")) for n in (2, 8)}
    steps = sorted(full)
    columns = [("4 ranks, uninterrupted", full), ("4 ranks, saved", saved)]
    columns += [(f"resumed at {n} (ucp)", r) for n, r in resumes.items()]

    print(f"{'step':>4}  " + "  ".join(f"{name:>24}" for name, _ in columns))
    for step in steps:
        cells = []
        for _, losses in columns:
            value = losses.get(step) if losses else None
            cells.append(f"{value:24.8f}" if value is not None else f"{'':>24}")
        print(f"{step:>4}  " + "  ".join(cells))
    for n, losses in resumes.items():
        if losses:
            delta = max(abs(losses[s] - full[s]) for s in losses)
            print(f"resume at {n} ranks under ucp: steps {min(losses)}..{max(losses)}, "
                  f"max |loss - uninterrupted| = {delta:.3e}")
        else:
            print(f"resume at {n} ranks under ucp: FAILED (see {out}/resume_dp{n}.log)")
    refusal_path = os.path.join(out, "refusal.txt")
    refusal = open(refusal_path).read().strip() if os.path.exists(refusal_path) else ""
    print(f"resume at 2 ranks without ucp: {refusal or 'did not fail (unexpected)'}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib (Debian: apt-get install python3-matplotlib): loss.png not drawn")
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(steps, [full[s] for s in steps], "k-", lw=2.5, label="4 ranks, uninterrupted")
    if saved:
        top.plot(sorted(saved), [saved[s] for s in sorted(saved)], "o", color="gray", ms=7, mfc="none",
                 label=f"4 ranks, saved at step {save_step}")
    styles = {2: ("tab:blue", "s"), 8: ("tab:orange", "^")}
    for n, losses in resumes.items():
        if losses:
            xs = sorted(losses)
            color, marker = styles[n]
            top.plot(xs, [losses[s] for s in xs], marker=marker, ls="--", color=color,
                     label=f"resumed at {n} ranks under ucp")
            bottom.semilogy(xs, [max(abs(losses[s] - full[s]), 1e-10) for s in xs], marker=marker, ls="--",
                            color=color, label=f"{n} ranks")
    for axis in (top, bottom):
        axis.axvline(save_step + 0.5, color="red", ls=":", lw=1)
    top.text(save_step + 0.6, max(full.values()), "topology change\n(no ucp: refused)", color="red", va="top",
             fontsize=9)
    top.set_ylabel("training loss (global batch mean)")
    top.set_title("Saved at 4 ranks, resumed at 2 and 8 with LD_PRELOAD=libucp.so")
    top.legend(loc="lower left", fontsize=9)
    bottom.set_ylabel("|loss - uninterrupted|\n(1e-10 = equal)")
    bottom.set_xlabel("step")
    bottom.set_ylim(1e-11, 1e-2)
    bottom.legend(fontsize=9)
    fig.tight_layout()
    png = os.path.join(out, "loss.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
