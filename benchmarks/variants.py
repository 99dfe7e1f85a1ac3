"""Ablation variants as the ablation scripts take them: ``NAME=override,override,...``.

The overrides are split at the commas outside brackets, so a list value stays one override
(``d0x2=train.depth_weights=[2,1,1,1,1,1,1,1],train.cod_r=0.9`` is two overrides). Used by
``benchmarks/cpu_ablation.py`` and ``benchmarks/quality_experiment.sh ablate`` (which calls this file and
reads one override per line). Standard library only: the GPU machine runs it before anything is installed.

    python3 benchmarks/variants.py 'd0x2=train.depth_weights=[2,1,1,1],train.cod_r=0.9'
    # train.depth_weights=[2,1,1,1]
    # train.cod_r=0.9
"""
from __future__ import annotations

import sys


def split_overrides(text: str) -> list[str]:
    """``"a=1,b=[1,2],c={x: 1, y: 2}"`` -> ``["a=1", "b=[1,2]", "c={x: 1, y: 2}"]``: split at the commas
    outside ``[]`` / ``{}``; empty pieces dropped.

    Raises:
        ValueError: unbalanced brackets (the message quotes the text).
    """
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in the overrides {text!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced brackets in the overrides {text!r}")
    out.append("".join(cur))
    return [o for o in out if o]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME=override,override"`` -> ``(NAME, [override, ...])``; ``"NAME="`` -> ``(NAME, [])``.

    Raises:
        ValueError: no ``=`` or an empty name; unbalanced brackets.
    """
    name, eq, rest = text.partition("=")
    if not eq or not name:
        raise ValueError(f"variant {text!r}: write NAME=override,override (NAME= alone for the base settings)")
    return name, split_overrides(rest)


if __name__ == "__main__":
    try:
        for o in parse_variant(sys.argv[1])[1]:
            print(o)
    except (ValueError, IndexError) as e:
        print(f"variants.py: {e}", file=sys.stderr)
        raise SystemExit(2)
