"""The GPU's clocks and power while a timed block runs: is a kernel slower because of what it computes, or
because the card slowed down under sustained load?

``nvidia-smi`` samples the streaming multiprocessors' clock, the power draw, the temperature and the active
throttle reasons every ``period_ms`` in a child process while the ``with`` block runs; the summary goes into a
benchmark's row (``gpu_clocks``). Issue 19's question it answers: FlexAttention's kernels ran at 0.68-0.77 of their
alone speed inside the N = 131,072 step (docs/benchmarks.md, "The N = 131,072 step's segments alone"); a step that
holds the card busy for 40 s may run at lower clocks than a kernel timed for a few seconds.

    with ClockSampler(device_index=0) as clocks:
        ...  # the timed calls
    row["gpu_clocks"] = clocks.summary()  # None where nvidia-smi is missing or gave no sample

Standard library only (the parsing is tested on CPU against recorded ``nvidia-smi`` lines).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile

#: nvidia-smi's fields, in this order (``--query-gpu``); ``clocks_throttle_reasons.active``: a bit mask, 0x0 = none
#: (NVML's: 0x1 idle, 0x2 applications clocks setting, 0x4 software power cap, 0x8 hardware slowdown, 0x20 / 0x40
#: software / hardware thermal slowdown, 0x80 power brake; ``nvidia-smi --help-query-gpu`` lists them)
FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
#: the same with the throttle reasons' newer name (drivers that renamed them "clock event reasons"), tried when a
#: driver refuses FIELDS
FIELDS_NEWER = (*FIELDS[:-1], "clocks_event_reasons.active")


def cuda_device_index(device) -> int:
    """The CUDA index of ``device`` (a ``torch.device``): its own, or the current device for a bare ``cuda``."""
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


def summarise_clock_lines(lines: list[str]) -> dict | None:
    """Summary of ``nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits`` lines.

    Args:
        lines: one sample a line, ``"1980, 2619, 512.34, 61, 0x0000000000000000"`` (MHz, MHz, W, degrees C,
            hex mask). Lines that do not parse (a header, ``[N/A]``, ``[Not Supported]``, a line cut when the
            sampler stopped) are skipped.

    Returns:
        ``{"samples", "sm_mhz_median", "sm_mhz_min", "sm_mhz_max", "mem_mhz_median", "power_w_median",
        "power_w_max", "temperature_c_max", "throttle_reasons"}`` (``throttle_reasons``: the distinct non-zero
        masks seen, as ``0x...`` strings, sorted), or None when no line parses.
    """
    sm, mem, power, temp, reasons = [], [], [], [], set()
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            s, m, p, t = float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3])
            mask = int(parts[4], 16)
        except ValueError:
            continue
        sm.append(s), mem.append(m), power.append(p), temp.append(t)
        if mask:
            reasons.add(f"{mask:#x}")
    if not sm:
        return None
    return {"samples": len(sm), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
            "sm_mhz_max": max(sm), "mem_mhz_median": statistics.median(mem),
            "power_w_median": statistics.median(power), "power_w_max": max(power), "temperature_c_max": max(temp),
            "throttle_reasons": sorted(reasons)}


def nvidia_smi_index(cuda_index: int, visible: str | None = None) -> int:
    """The ``nvidia-smi --id`` of the process's CUDA device ``cuda_index``: ``CUDA_VISIBLE_DEVICES`` (``visible``;
    default: the environment's) renumbers devices for CUDA but not for ``nvidia-smi``. A list of integers maps
    ``cuda_index`` through it (``"3,5"``: 1 -> 5); unset, empty or not integers (UUIDs): ``cuda_index`` itself.
    Assumes CUDA numbers the cards in nvidia-smi's (PCI bus) order, as on a host of one GPU kind; on a host of mixed
    kinds set ``CUDA_DEVICE_ORDER=PCI_BUS_ID``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if ids and all(v.isdigit() for v in ids) and cuda_index < len(ids):
        return int(ids[cuda_index])
    return cuda_index


class ClockSampler:
    """Context manager: ``nvidia-smi`` samples GPU ``device_index`` every ``period_ms`` (milliseconds) while the
    block runs; :meth:`summary` then gives :func:`summarise_clock_lines` of what it printed.

    A single query first finds the field names the driver takes (:data:`FIELDS`, else :data:`FIELDS_NEWER`).
    Without ``nvidia-smi`` on ``PATH`` (``exe``: another executable with the same arguments), or where it refuses
    both, the block runs unsampled and :meth:`summary` is None: a benchmark row then says ``"gpu_clocks": null``
    rather than failing.
    """

    def __init__(self, device_index: int = 0, period_ms: int = 250, exe: str = "nvidia-smi"):
        self.exe, self.device_index, self.period_ms = exe, device_index, period_ms
        self.proc: subprocess.Popen | None = None
        self.out = None  # nvidia-smi's output, a temporary file (a pipe read only at the end would fill and stall it)
        self.fields: tuple[str, ...] | None = None  # the names this driver takes, found at the first block
        self.lines: list[str] = []

    def _query(self, fields: tuple[str, ...]) -> list[str]:
        return [self.exe, f"--id={self.device_index}", f"--query-gpu={','.join(fields)}",
                "--format=csv,noheader,nounits"]

    def _fields_taken(self) -> tuple[str, ...] | None:
        """One sample with :data:`FIELDS`, else :data:`FIELDS_NEWER`: the names this driver takes (None: neither,
        or no executable)."""
        if shutil.which(self.exe) is None:
            return None
        for fields in (FIELDS, FIELDS_NEWER):
            try:
                once = subprocess.run(self._query(fields), capture_output=True, text=True, timeout=30, check=False)
            except (OSError, subprocess.TimeoutExpired):
                return None
            if once.returncode == 0:
                return fields
        return None

    def __enter__(self) -> ClockSampler:
        self.lines = []
        self.fields = self.fields or self._fields_taken()  # found once, at the first block
        if self.fields is not None:
            self.out = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen([*self._query(self.fields), f"--loop-ms={self.period_ms}"],
                                         stdout=self.out, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.seek(0)
        self.lines = self.out.read().splitlines()
        self.out.close()
        self.proc, self.out = None, None

    def summary(self) -> dict | None:
        """The block's summary (:func:`summarise_clock_lines`), None when nothing was sampled."""
        return summarise_clock_lines(self.lines)
