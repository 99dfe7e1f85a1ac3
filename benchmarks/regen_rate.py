"""The regeneration rate of one ``quality_experiment.sh prepare`` call, from the shards it wrote.

    python benchmarks/regen_rate.py REGEN_DIR T0 WORKERS OUT.json

``REGEN_DIR`` holds the regeneration shards (``peagle_train.stages._regenerate_sharded``: one JSON per shard
with the engine's ``report``); the shards modified at or after ``T0`` (Unix seconds, the call's start) are
this call's. Their ``generated_tokens`` are summed and divided by the wall time since ``T0``: the rate a user
gets from the call, the target's load, compiles and the tokenisation included (each shard's own
``tokens_per_s`` counts its ``generate`` calls alone and, with several workers on one GPU, overlaps the
others'). Standard library only: it runs under any ``python3``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def regen_rate(regen: Path, t0: float, workers: int, now: float | None = None) -> dict:
    """``{"shards_written", "workers", "generated_tokens", "unfinished_responses", "wall_s", "tokens_per_s_wall",
    "sampling", "note"}`` of the shards in ``regen`` modified at or after ``t0`` (seconds); ``now``: the end
    of the wall time (default: the current time). A missing folder counts no shard; a shard grown in the call
    (its report's ``grown_from``: the part made before) counts only its appended part. A shard that is not
    JSON raises ``ValueError`` naming it."""
    now = time.time() if now is None else now
    new = [p for p in sorted(regen.glob("*.json")) if p.stat().st_mtime >= t0] if regen.is_dir() else []
    reports = []
    for p in new:
        try:
            reports.append(json.loads(p.read_text()).get("report") or {})
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a regeneration shard ({e})") from None
    wall = max(now - t0, 0.0)

    def made_here(r: dict, key: str) -> int:  # a grown shard's earlier part (grown_from) was made before this call
        return r.get(key, 0) - (r.get("grown_from") or {}).get(key, 0)

    tokens = sum(made_here(r, "generated_tokens") for r in reports)
    return {"shards_written": len(new), "workers": workers, "generated_tokens": tokens,
            "unfinished_responses": sum(made_here(r, "unfinished_responses") for r in reports),
            "wall_s": round(wall, 1), "tokens_per_s_wall": round(tokens / wall, 1) if wall > 0 else None,
            "sampling": reports[0].get("sampling") if reports else None,
            "note": "wall time of the whole call: the target's load, compiles and the tokenisation included"}


def main(argv=None) -> dict:
    """The command line above: writes OUT.json and prints one line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        sys.exit("usage: regen_rate.py REGEN_DIR T0 WORKERS OUT.json")
    try:
        rate = regen_rate(Path(args[0]), float(args[1]), int(args[2]))
    except ValueError as e:
        sys.exit(f"regen_rate: {e}")
    Path(args[3]).write_text(json.dumps(rate, indent=1))
    print(f"regeneration in this call: {rate['generated_tokens']:,} generated tokens in {rate['shards_written']} "
          f"shards by {rate['workers']} worker{'s' if rate['workers'] != 1 else ''}, {rate['tokens_per_s_wall']} tokens/s over {rate['wall_s']:.0f} s")
    return rate


if __name__ == "__main__":
    main()
