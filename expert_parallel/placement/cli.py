"""`placement tune` and `placement report`: a thin command line over tuner.py and placement.py.

    placement tune   --load L --gpus G --nodes N --slots S [--groups K] [--decay D] --out P
    placement report --load L --placement P --gpus G --nodes N [--groups K]

report fits the baselines on every window but the last and judges everything on the last (held
out), so the numbers say how each placement would have fared on load it had not seen. Bad input
prints one line naming the field on stderr and exits with 2.

Wired into `moe-serve` with add_placement_parser(subparsers) and run_placement(args); runs alone as
`python -m expert_parallel.placement.cli placement ...`.
"""
from __future__ import annotations

import argparse
import sys

from expert_parallel.placement import tuner
from expert_parallel.placement.map import (Placement, PlacementError, load_expert_load, load_placement, save_placement,
                                           window_weights)


def _decay(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--decay={text!r} is not a number or 'auto'") from None


def add_placement_parser(subparsers) -> argparse.ArgumentParser:
    """Register `placement {tune,report}` on an argparse subparsers object."""
    p = subparsers.add_parser("placement", help="tune and judge expert placements from recorded load")
    sub = p.add_subparsers(dest="placement_command", required=True)

    t = sub.add_parser("tune", help="write a placement that balances the next window's load")
    t.add_argument("--load", required=True, help="load file (JSON with expert_load)")
    t.add_argument("--gpus", type=int, required=True, help="GPUs in the expert-parallel group")
    t.add_argument("--nodes", type=int, required=True, help="nodes the GPUs span")
    t.add_argument("--slots", type=int, required=True, help="physical expert slots per layer (>= experts)")
    t.add_argument("--groups", type=int, default=None, help="expert groups of a group-limited router")
    t.add_argument("--decay", type=_decay, default=None,
                   help="weight of a window relative to the next newer one, or 'auto' (backtest; default)")
    t.add_argument("--hedge", type=float, default=tuner.TuneConfig.hedge,
                   help="z of the forecast upper quantile GPUs are scored by (0: the mean)")
    t.add_argument("--locality-tolerance", type=float, default=tuner.TuneConfig.locality_tolerance,
                   help="relative balance given up to keep expert groups inside nodes")
    t.add_argument("--holdout", type=int, default=0, help="leave out the newest windows (to judge later)")
    t.add_argument("--num-layers", type=int, default=None, help="the model's MoE layer count, to check")
    t.add_argument("--out", required=True, help="placement file to write")

    r = sub.add_parser("report", help="balance and cross-node share on the held-out last window")
    r.add_argument("--load", required=True)
    r.add_argument("--placement", required=True)
    r.add_argument("--gpus", type=int, required=True)
    r.add_argument("--nodes", type=int, required=True)
    r.add_argument("--groups", type=int, default=None,
                   help="expert groups (default: the placement's 'groups', else one per node)")
    for q in (p, t, r):
        q.set_defaults(func=run_placement)
    return p


def _tune(args) -> int:
    load, meta = load_expert_load(args.load, args.num_layers)
    if not 0 <= args.holdout < len(load):
        raise PlacementError(f"holdout={args.holdout} must leave at least one of the {len(load)} windows")
    fit = load[: len(load) - args.holdout]
    weights = window_weights(meta, len(load))  # a partial last window weighs its share of the steps
    config = tuner.TuneConfig(decay=args.decay, hedge=args.hedge, locality_tolerance=args.locality_tolerance)
    p2l, infos = tuner.tune(fit, args.gpus, args.nodes, args.slots, args.groups, config,
                            None if weights is None else weights[: len(fit)])
    meta = {"groups": args.groups, "tuner": {
        "fit_windows": len(fit), "total_windows": len(load), "hedge": args.hedge,
        "locality_tolerance": args.locality_tolerance,
        "decay": [i["decay"] for i in infos], "mode": [i["mode"] for i in infos]}}
    placement = Placement(p2l.tolist(), args.gpus, args.nodes, load.shape[2], meta)
    save_placement(placement, args.out)
    modes = {m: meta["tuner"]["mode"].count(m) for m in dict.fromkeys(meta["tuner"]["mode"])}
    print(f"wrote {args.out}: {placement.num_layers} layers x {placement.slots} slots on {args.gpus} GPUs "
          f"/ {args.nodes} nodes, fit on {len(fit)} windows; layer modes {modes}")
    return 0


def _row(m: dict, i: int | None) -> str:
    if i is None:
        return f"{m['overall_balancedness']:6.3f} {m['overall_max_load']:10.0f} {m['overall_cross_node']:6.3f}"
    return f"{m['balancedness'][i]:6.3f} {m['max_load'][i]:10.0f} {m['cross_node'][i]:6.3f}"


def _report(args) -> int:
    placement = load_placement(args.placement)
    load, _ = load_expert_load(args.load)
    W, L, E = load.shape
    if L != placement.num_layers:
        raise PlacementError(f"expert_load has {L} layers but physical_to_logical has {placement.num_layers}")
    if E != placement.num_logical_experts:
        raise PlacementError(f"expert_load has {E} experts per layer but the placement's "
                             f"num_logical_experts={placement.num_logical_experts}")
    for name in ("gpus", "nodes"):
        if getattr(args, name) != getattr(placement, name):
            raise PlacementError(f"--{name}={getattr(args, name)} but the placement was made for "
                                 f"{name}={getattr(placement, name)}")
    if W < 2:
        raise PlacementError(f"expert_load has {W} window; report fits on all but the last, so it needs 2")
    groups = args.groups or placement.metadata.get("groups") or None
    fit, test = load[:-1], load[-1]
    S = placement.slots
    tuner.check_shape(E, S, args.gpus, args.nodes, groups)
    results = {
        "placement": tuner.evaluate(test, placement.physical_to_logical, args.gpus, args.nodes, groups),
        "greedy": tuner.evaluate(test, tuner.greedy_layout(fit.sum(0), args.gpus, args.nodes, S, groups),
                                 args.gpus, args.nodes, groups),
        "no-replica": tuner.evaluate(test, tuner.no_replica_layout(L, E, S), args.gpus, args.nodes, groups),
    }
    print(f"held-out window {W} of {W} (baselines fit on windows 1-{W - 1}); {L} layers x {E} experts, "
          f"{S} slots, {args.gpus} GPUs, {args.nodes} nodes, "
          + (f"{groups} expert groups" if groups else "one expert group per node (no --groups)"))
    fit_windows = placement.metadata.get("tuner", {}).get("fit_windows") if isinstance(
        placement.metadata.get("tuner"), dict) else None
    if fit_windows is not None and fit_windows >= W:
        print(f"note: the placement was tuned on {fit_windows} windows, so it saw the judged one; "
              "tune with --holdout 1 for a held-out comparison")
    print("balancedness = mean/max GPU load; max = tokens on the busiest GPU; xnode = share of token "
          "copies computed off their group's home node")
    head = "".join(f" | {name:^24}" for name in results)
    print(f"{'layer':>7}{head}")
    print(f"{'':>7}" + " | {:>6} {:>10} {:>6}".format("bal", "max", "xnode") * len(results))
    for i in range(L):
        print(f"{i:>7}" + "".join(f" | {_row(m, i)}" for m in results.values()))
    print(f"{'overall':>7}" + "".join(f" | {_row(m, None)}" for m in results.values()))
    return 0


def run_placement(args) -> int:
    """Run a parsed `placement` command; returns the exit code (2 for bad input)."""
    try:
        if args.placement_command == "tune":
            return _tune(args)
        return _report(args)
    except (PlacementError, ValueError, OSError) as e:
        # One line that names the field: these are the user's inputs, not our bugs.
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expert_parallel.placement.cli")
    add_placement_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
