"""Where a training step's time goes: ``torch.profiler`` over chosen steps of the real loop.

``train.profile_steps: n`` (``n > 0``) profiles optimizer steps ``profile_start + 1 ..
profile_start + n`` of ``peagle-train train`` (CPU ops, and CUDA kernels on a GPU) and writes
``<output_dir>/logs/profile.json``:

* ``ranges``: per step, the host (CPU) milliseconds of each phase the trainer marks with
  :func:`torch.profiler.record_function` (``peagle/features``, ``peagle/host_inputs``,
  ``peagle/plan``, ``peagle/forward_backward``, ``peagle/optimizer``, ``peagle/stats``,
  ``peagle/eval``, ``peagle/log``): host time, which is GPU time only where the host waits;
* ``timeline``: the GPU's busy and idle milliseconds per step (:func:`timeline_summary`): idle time
  is where the GPU waits for the host (input building, target forward launches, syncs);
* ``top``: the top CUDA kernels (CPU ops on a CPU) by time per step (:func:`kernel_table`);
* ``step_ms``: the wall time of each profiled step (profiler overhead included).

The helpers are also what ``benchmarks/train_step.py --profile`` reports.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from peagle_train.core.atomic import write_json_atomic

#: The phases the trainer marks (record_function names), in step order.
PHASES = ("peagle/features", "peagle/host_inputs", "peagle/plan", "peagle/forward_backward", "peagle/optimizer",
          "peagle/stats", "peagle/eval", "peagle/log")


def _is_device_kernel(e) -> bool:
    """A profiler event that is a CUDA kernel or copy, not an annotated range (``Optimizer.step#...``,
    Inductor's ``## Call CompiledFxGraph ##``), which the profiler also lists on the device."""
    from torch.autograd import DeviceType

    return getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def kernel_table(prof, step_ms: float, n_steps: int, top: int = 25) -> list[dict]:
    """Top ``top`` CUDA kernels of a profile (CPU ops when there are no kernels): name, ms per step
    (total / ``n_steps``), % of the measured step time ``step_ms``, calls per step."""
    events = prof.key_averages()
    gpu = [e for e in events if _is_device_kernel(e)]

    def dev_us(e):
        for k in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
            v = getattr(e, k, None)
            if v:
                return float(v)
        return 0.0

    if gpu:
        rows = [(e.key, dev_us(e), e.count) for e in gpu]
    else:
        rows = [(e.key, float(e.self_cpu_time_total), e.count) for e in events]
    rows.sort(key=lambda x: -x[1])
    out = []
    for name, us, count in rows[:top]:
        ms = us / 1e3 / n_steps
        out.append({"name": name[:120], "ms_per_step": round(ms, 3),
                    "pct_of_step": round(100 * ms / step_ms, 2) if step_ms else None,
                    "calls_per_step": round(count / n_steps, 1)})
    return out


KERNEL_CATEGORIES = (  # first match wins; names as the CUDA profiler reports them (torch 2.11, H200)
    ("flex attention backward", ("flex_attention_backward",)),
    ("flex attention forward", ("flex_attention",)),
    ("GEMM (cuBLAS / CUTLASS)", ("nvjet", "gemm", "cutlass", "magma", "sm90_xmma")),
    ("optimizer (fused multi-tensor)", ("multi_tensor_apply",)),
    ("copies", ("memcpy", "memset", "direct_copy", "copy_kernel")),
    ("chain part (Triton kernels, train.chain_kernel)", ("_chain_",)),
    ("Inductor fused (norms, RoPE, loss, chain part, ...)", ("triton_",)),  # the chain part: chain_kernel torch
)


def kernel_category(name: str) -> str:
    """Coarse category of a CUDA kernel name (:data:`KERNEL_CATEGORIES`; anything else: ``other``)."""
    low = name.lower()
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def timeline_summary(kernels: list[tuple[str, float, float]], n_steps: int) -> dict:
    """GPU busy and idle time of a profiled window, from kernel intervals.

    Args:
        kernels: ``(name, start_us, end_us)`` of every device kernel / copy of ``n_steps`` steps.
        n_steps: steps in the window (``>= 1``).

    Returns:
        ``{"window_ms", "busy_ms", "idle_ms"}`` per step (the window spans the first start to the
        last end; busy is the union of the intervals, so overlapping kernels on several streams
        count once; idle = window - busy) and ``"by_category"``: ``{category: ms per step}`` of
        summed kernel time (:func:`kernel_category`), largest first. Empty input gives zeros.

    Raises:
        ValueError: ``n_steps < 1`` or an interval that ends before it starts.
    """
    if n_steps < 1:
        raise ValueError(f"timeline_summary: n_steps must be >= 1, got {n_steps}")
    if any(e < b for _, b, e in kernels):
        raise ValueError("timeline_summary: an interval ends before it starts")
    cats: dict[str, float] = {}
    busy, cur_b, cur_e = 0.0, None, None
    for name, b, e in sorted(kernels, key=lambda x: x[1]):
        cat = kernel_category(name)
        cats[cat] = cats.get(cat, 0.0) + (e - b)
        if cur_e is None or b > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_b
            cur_b, cur_e = b, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_b
    window = (max(e for _, _, e in kernels) - min(b for _, b, _ in kernels)) if kernels else 0.0
    per = 1e3 * n_steps
    return {"window_ms": round(window / per, 3), "busy_ms": round(busy / per, 3),
            "idle_ms": round((window - busy) / per, 3),
            "by_category": {k: round(v / per, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}}


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the device kernels and copies in a ``torch.profiler`` run
    (empty on CPU-only runs)."""
    return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
            if _is_device_kernel(e) and e.time_range.end > e.time_range.start]




def range_table(prof, n_steps: int) -> dict[str, dict]:
    """Per step, for every :data:`PHASES` range in a profile: ``cpu_ms``, the host's wall time inside
    the range, and ``calls``; on a GPU also ``gpu_span_ms``, the span from the first to the last
    kernel the range launched (the profiler's device-side annotation; a span, not busy time). Phases
    that did not run are left out."""
    from torch.autograd import DeviceType

    out: dict[str, dict] = {}
    for e in prof.key_averages():
        if e.key not in PHASES:
            continue
        row = out.setdefault(e.key, {})
        if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU:
            row.update(cpu_ms=round(e.cpu_time_total / 1e3 / n_steps, 3), calls=round(e.count / n_steps, 2))
        else:
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            row["gpu_span_ms"] = round(float(dev) / 1e3 / n_steps, 3)
    return {k: out[k] for k in PHASES if k in out}


class StepProfiler:
    """``torch.profiler`` around optimizer steps ``start + 1 .. start + n`` of a training loop.

    Call :meth:`before_step` and :meth:`after_step` around every step (they do nothing outside the
    window, and nothing at all when ``n == 0``); after the window closes the summary is written to
    ``path`` (JSON, atomically) and kept in :attr:`summary`.

    Args:
        n: steps to profile (0 = off). start: optimizer steps to run first (warm-up, compilation).
        path: the JSON file. trace: also write the Chrome trace beside it (``profile_trace.json``).
    """

    def __init__(self, n: int, start: int, path: Path, trace: bool = False):
        self.n, self.start, self.path, self.trace = n, start, Path(path), trace
        self.prof = None
        self.step_ms: list[float] = []
        self.summary: dict | None = None
        self._t0 = 0.0

    def active(self, step: int) -> bool:
        """True when 0-based optimizer step ``step`` (about to run) is in the window."""
        return self.n > 0 and self.start <= step < self.start + self.n

    def before_step(self, step: int) -> None:
        if not self.active(step):
            return
        if self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def after_step(self, step: int) -> None:
        """``step``: the 0-based step that just ran. Closes the window and writes the summary after its last step."""
        if not self.active(step) or self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_ms.append((time.perf_counter() - self._t0) * 1e3)
        if step == self.start + self.n - 1:
            self.finish()

    def finish(self) -> None:
        """Stop the profiler (if running) and write the summary of the steps profiled so far."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        n = max(len(self.step_ms), 1)
        med = sorted(self.step_ms)[len(self.step_ms) // 2] if self.step_ms else 0.0
        self.summary = {"steps": [self.start + 1, self.start + len(self.step_ms)], "step_ms": self.step_ms,
                        "ranges": range_table(prof, n), "top": kernel_table(prof, med, n),
                        "timeline": timeline_summary(device_kernels(prof), n) if torch.cuda.is_available() else None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.summary)
        if self.trace:
            prof.export_chrome_trace(str(self.path.with_name("profile_trace.json")))
