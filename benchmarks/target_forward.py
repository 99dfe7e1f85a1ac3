"""The target's feature forward (what the online trainer and ``peagle-train cache`` run every step) under each
attention and mixture-of-experts implementation transformers offers, on ONE loaded target: time, peak memory,
and agreement of the features with the first variant's.

The target is loaded by :func:`peagle_train.features.target.load_target` from a recipe and overrides (the same
loader as the trainer, so ``target.random_init_from_config`` gives a real architecture with random weights),
then each ``--variants`` entry ``ATTN/EXPERTS`` is switched on the same weights with transformers' own
``set_attn_implementation`` / ``set_experts_implementation`` (``eager``, ``flex_attention``, ``sdpa`` /
``eager``, ``grouped_mm``, ``batched_mm``; ``keep`` keeps what the model was loaded with) and timed through
:meth:`peagle_train.features.target.Target.features` on ``--batch`` right-padded rows of ``--length`` random
token ids (the online trainer's padded forward): median of ``--steps`` after ``--warmup``, peak allocated
bytes of one call, and against the first variant the largest absolute difference of ``aux`` and ``last``
relative to the reference's largest magnitude, and the fraction of equal greedy tokens (a random-weight
target's logits are near ties, so bf16 rounding flips some of them: read it as a check for gross errors, not
as exactness; ``tests/unit/test_target_architectures.py`` holds the float64 equality of the captured
features with the transformers reference forward).

GPU (issue 22: the cost of the GPT-OSS-20B-shaped target inside the online step)::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/target_forward.py recipes/gpt-oss-20b.yaml \\
        target.path=null target.random_init_from_config=pkg:peagle_train/gpt-oss-20b.json \\
        --batch 3 --length 3439 --variants keep/keep eager/eager eager/grouped_mm flex_attention/grouped_mm \\
        --out $OUT/target_forward.json

CPU smoke (CI, ``tests/integration/test_benchmarks.py``): ``--smoke --out x.json`` (the tiny GPT-OSS
configuration, float32).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = ["recipes/gpt-oss-20b.yaml", "target.path=null", "target.device=cpu", "target.dtype=float32",
         "target.random_init_from_config=pkg:peagle_train/gpt-oss-20b-tiny.json", "target.attn_implementation=eager"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", nargs="?", help="recipe YAML (then key=value overrides)")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    p.add_argument("--batch", type=int, default=3, help="rows per forward")
    p.add_argument("--length", type=int, default=2048, help="tokens per row")
    p.add_argument("--variants", nargs="+", default=["keep/keep", "eager/eager", "eager/grouped_mm"],
                   help="ATTN/EXPERTS pairs; 'keep' keeps the loaded model's; the first is the reference")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny GPT-OSS configuration, 2 x 64 tokens")
    p.add_argument("--out", help="JSON file")
    p.add_argument("--verdict", metavar="JSON", help="instead of a run: attn-check's verdict on an earlier --out "
                   "(eager first, flex_attention after it); exit 0 when flex_attention agrees, 1 when not")
    a = p.parse_args(argv)
    if a.verdict:
        return a
    if not a.out:
        p.error("--out is required")
    if a.smoke:
        a.recipe, a.overrides = SMOKE[0], SMOKE[1:] + a.overrides
        a.batch, a.length, a.steps, a.warmup = 2, 64, 2, 1
    if a.recipe is None:
        p.error("give a recipe (or --smoke)")
    bad = [v for v in a.variants if v.count("/") != 1 or "" in v.split("/")]
    if bad:
        p.error(f"--variants {' '.join(bad)}: each is ATTN/EXPERTS, e.g. eager/grouped_mm or flex_attention/keep")
    return a


def implementations(model) -> dict:
    """The attention and experts implementations the model runs now (transformers' config fields)."""
    c = model.config
    return {"attn": getattr(c, "_attn_implementation", None), "experts": getattr(c, "_experts_implementation", None)}


def switch(model, attn: str, experts: str) -> None:
    """Switch the loaded model to ``attn`` / ``experts`` (``keep`` = leave) through transformers' setters.

    Raises:
        ValueError: transformers refuses the implementation, or this transformers has no experts setter.
    """
    if attn != "keep":
        model.set_attn_implementation(attn)
    if experts != "keep":
        if not hasattr(model, "set_experts_implementation"):
            raise ValueError("this transformers has no set_experts_implementation")
        model.set_experts_implementation(experts)


def time_variant(target, ids, steps: int, warmup: int) -> tuple[dict, dict]:
    """Median wall ms of ``target.features(ids)`` (device-synchronised) and the last call's features."""
    import torch

    dev = ids.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        target.features(ids)
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        f = target.features(ids)
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else None
    return {"step_ms": statistics.median(ms), "step_ms_all": ms, "transient_peak_bytes": peak}, f


def _rel(a, b) -> float:
    """Largest |a - b| over the largest |b| (float32)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


# attn-check's verdict (``verdict``): what separates a wrong attention kernel from a mixture-of-experts target's
# rounding. A kernel that drops the sinks, the sliding window or the causal mask is wrong for most tokens from the
# first layer on, so the first tapped layer (layer 2 of 24: a sliding-window and a full-attention layer behind it)
# must agree to float32 rounding and most tokens must agree at every tapped layer. A router's top-k is a
# discontinuous choice: a near tie that rounding flips gives that token other experts, a difference of the
# order of its hidden state that attention then spreads, thinly, to later tokens. So a tapped layer may differ by
# more than ``MAX_REL`` only where the routing of some token changed before it, and only on a few tokens.
FIRST_TAP_REL = 1e-4   # largest |difference| at the first tapped layer, over the reference's largest |value|
MEDIAN_TOKEN_REL = 1e-4  # the median token's largest |difference| at every tapped layer, same scale
MAX_REL = 1e-2         # largest |difference| at a tapped layer with no routing change before it
TOKENS_OFF_REL = 1e-2  # a token is "off" when its largest |difference| exceeds this, same scale ...
TOKENS_OFF_MAX = 0.01  # ... and at most this fraction of the tokens may be off at any tapped layer
GREEDY_EQUAL_MIN = 0.99  # fraction of equal greedy next tokens


def router_layers(model) -> dict:
    """``{decoder layer index: router module}`` of a mixture-of-experts target: modules whose class name ends in
    ``Router`` (transformers' ``GptOssTopKRouter``, …) under ``….layers.<i>.…``; ``{}`` for a dense target."""
    import re

    found = {}
    for name, module in model.named_modules():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m and type(module).__name__.endswith("Router"):
            found[int(m.group(1))] = module
    return found


@contextmanager
def recorded_routing(model):
    """Record the experts each router picks during the forwards inside the ``with``.

    Yields:
        dict ``{layer index: int64 [tokens, top_k]}``, each row sorted (the set of experts, not their order), on
        the CPU; a router called again overwrites its entry. The indices are the last integer tensor of the
        router's output (``GptOssTopKRouter`` returns ``(logits, scores, indices)``). Empty for a dense target.
    """
    import torch

    got, handles = {}, []

    def keep(i):
        def hook(module, args, output):
            outs = output if isinstance(output, tuple) else (output,)
            ints = [o for o in outs if torch.is_tensor(o) and not o.is_floating_point()]
            if ints:
                got[i] = ints[-1].reshape(-1, ints[-1].shape[-1]).sort(-1).values.cpu()
        return hook

    handles = [m.register_forward_hook(keep(i)) for i, m in router_layers(model).items()]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def agreement(f: dict, ref: dict, aux_layer_ids, routes: dict | None = None, ref_routes: dict | None = None) -> dict:
    """How far the features ``f`` are from the reference's ``ref`` (both ``Target.features`` dicts: ``aux``
    ``[B, N, A*T]``, ``last`` ``[B, N, T]``, ``argmax`` ``[B, N]``), all relative to the reference's largest
    magnitude (per tapped layer for ``aux``):

    - ``aux_rel_max_diff`` / ``last_rel_max_diff``: largest |difference|;
    - ``aux_rel_max_diff_by_layer``: the same per tapped layer, low to high (``aux_layer_ids``): a wrong attention
      kernel shows at the first tapped layer already, rounding grows with depth;
    - ``aux_token_rel_diff_median_by_layer`` / ``aux_tokens_off_by_layer``: per token (its largest |difference|
      over the layer's largest reference magnitude), the median and the fraction above ``TOKENS_OFF_REL``;
    - ``argmax_equal``: the fraction of equal greedy tokens;
    - with ``routes`` / ``ref_routes`` (``recorded_routing`` of the two forwards, a mixture-of-experts target):
      ``routing_changed_tokens_by_layer`` ``{layer: tokens whose set of experts differs}`` and
      ``routing_changed_before_tap``, per tapped layer the tokens whose routing differs in a layer before it
      (aux layer id ``i`` is the output of decoder layer ``i - 1``).
    """
    import torch

    n = len(aux_layer_ids)
    by_layer, median, off = [], [], []
    for a, b in zip(f["aux"].chunk(n, -1), ref["aux"].chunk(n, -1)):
        scale = b.float().abs().max().clamp_min(1e-30)
        tok = ((a.float() - b.float()).abs().amax(-1) / scale).flatten()
        by_layer.append(float(tok.max()))
        median.append(float(tok.median()))
        off.append(float((tok > TOKENS_OFF_REL).float().mean()))
    out = {"aux_rel_max_diff": _rel(f["aux"], ref["aux"]), "aux_rel_max_diff_by_layer": by_layer,
           "aux_token_rel_diff_median_by_layer": median, "aux_tokens_off_by_layer": off,
           "last_rel_max_diff": _rel(f["last"], ref["last"]),
           "argmax_equal": float((f["argmax"] == ref["argmax"]).float().mean())}
    if routes and ref_routes:
        changed = {i: (routes[i] != ref_routes[i]).any(-1) for i in sorted(ref_routes) if i in routes}
        out["routing_changed_tokens_by_layer"] = {str(i): int(c.sum()) for i, c in changed.items()}
        before = []
        for t in aux_layer_ids:
            rows = [c for i, c in changed.items() if i < t]
            before.append(int(torch.stack(rows).any(0).sum()) if rows else 0)
        out["routing_changed_before_tap"] = before
    return out


def verdict(result: dict) -> tuple[bool, str]:
    """attn-check's rule on a ``target_forward.py`` result (``meta`` and ``rows``: the first row the eager
    reference, then a ``flex_attention`` row, any others as context): does flex_attention give the eager target's
    features?

    True when the first tapped layer agrees within ``FIRST_TAP_REL``, the median token within
    ``MEDIAN_TOKEN_REL`` at every tapped layer, at most ``TOKENS_OFF_MAX`` of the tokens are off by more than
    ``TOKENS_OFF_REL``, a tapped layer differs by more than ``MAX_REL`` only where some token's routing changed
    before it, and ``GREEDY_EQUAL_MIN`` of the greedy tokens are equal (the reasons: the comment above
    ``FIRST_TAP_REL``). Returns the verdict and a one-line account.

    Raises:
        ValueError: there is no flex_attention row, or it did not run (its error, e.g. sinks on a CPU).
    """
    rows = result["rows"]
    flex = next((r for r in rows[1:] if r.get("variant", "").startswith("flex_attention")), None)
    if flex is None:
        raise ValueError("attn-check: no flex_attention row")
    if flex.get("error"):
        raise ValueError(f"attn-check: flex_attention did not run: {flex['error'][:300]}")
    layers, med, off = (flex["aux_rel_max_diff_by_layer"], flex["aux_token_rel_diff_median_by_layer"],
                        flex["aux_tokens_off_by_layer"])
    rerouted = flex.get("routing_changed_before_tap") or [0] * len(layers)
    ok = (layers[0] < FIRST_TAP_REL and max(med) < MEDIAN_TOKEN_REL and max(off) <= TOKENS_OFF_MAX
          and all(x < MAX_REL or r > 0 for x, r in zip(layers, rerouted))
          and flex["argmax_equal"] >= GREEDY_EQUAL_MIN)
    fmt = lambda xs: ", ".join(f"{x:.2e}" for x in xs)  # noqa: E731
    msg = (f"attn-check: flex_attention {'AGREES' if ok else 'DIFFERS'} with eager in {result['meta']['dtype']}"
           f": by tapped layer the relative max difference {fmt(layers)}, the median token's {fmt(med)}, tokens off "
           f"by > {TOKENS_OFF_REL:g} {', '.join(f'{x:.2%}' for x in off)}")
    if "routing_changed_before_tap" in flex:
        msg += f", tokens rerouted before the tap {', '.join(map(str, rerouted))}"
    msg += f"; greedy tokens equal {flex['argmax_equal']:.4f}; {rows[0]['step_ms']:.0f} ms eager, {flex['step_ms']:.0f} ms flex"
    for r in rows[1:]:
        if r is not flex and not r.get("error") and "aux_rel_max_diff_by_layer" in r:
            msg += (f"; {r['variant']} against the reference: {fmt(r['aux_rel_max_diff_by_layer'])}"
                    + (f", rerouted {', '.join(map(str, r['routing_changed_before_tap']))}"
                       if "routing_changed_before_tap" in r else ""))
    return ok, msg


def main(argv=None) -> dict:
    import torch

    from benchmarks.train_step import provenance
    from peagle_train.features.target import load_target
    from peagle_train.recipe import load_config

    args = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(args)
    if a.verdict:
        try:
            result = json.loads(Path(a.verdict).read_text())
        except (OSError, ValueError) as e:  # missing, unreadable or not JSON: say which file and what to do
            sys.exit(f"--verdict {a.verdict}: cannot read attn-check's result ({e}); give the JSON an earlier "
                     "`target_forward.py ... --out FILE` wrote")
        try:
            ok, msg = verdict(result)
        except ValueError as e:
            sys.exit(f"--verdict {a.verdict}: {e}")
        print(msg, flush=True)
        sys.exit(0 if ok else 1)
    cfg = load_config(a.recipe, a.overrides)
    t0 = time.perf_counter()
    target = load_target(cfg.target, with_tokenizer=False)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (a.batch, a.length), generator=g).to(target.device)
    out = {"meta": {**provenance(args, "benchmarks/target_forward.py"),
                    "recipe": a.recipe, "overrides": a.overrides, "batch": a.batch, "length": a.length,
                    "tokens": a.batch * a.length, "dtype": cfg.target.dtype, "device": str(target.device),
                    "gpu": torch.cuda.get_device_name() if target.device.type == "cuda" else None,
                    "random_weights": cfg.target.random_init_from_config is not None, "load_s": load_s,
                    "loaded_with": implementations(target.model),
                    "timing": f"median of {a.steps} calls of Target.features after {a.warmup}"}, "rows": []}
    ref = None
    for v in a.variants:
        attn, experts = v.split("/")
        row = {"variant": v}
        try:
            switch(target.model, attn, experts)
            row["runs_with"] = implementations(target.model)
            timing, f = time_variant(target, ids, a.steps, a.warmup)
            row.update(timing)
            row["tokens_per_s"] = a.batch * a.length / (timing["step_ms"] / 1e3)
            if router_layers(target.model):  # one more (untimed) forward: which experts each token got
                with recorded_routing(target.model) as routes:
                    f = target.features(ids)
            else:
                routes = None
            if ref is None:
                ref, ref_routes = f, routes
            else:
                row.update(agreement(f, ref, target.aux_layer_ids, routes, ref_routes))
        except Exception as e:  # noqa: BLE001 -- one refused variant must not lose the others' rows
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["rows"].append(row)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(json.dumps({k: row.get(k) for k in ("variant", "runs_with", "step_ms", "tokens_per_s",
                                                   "aux_rel_max_diff", "argmax_equal", "error")}), flush=True)
    return out


if __name__ == "__main__":
    main()
