"""benchmarks/gpu_clocks.py: the GPU's clocks over a timed block, parsed from nvidia-smi's lines (CPU: recorded lines
and a stand-in executable)."""
from __future__ import annotations

import stat
import textwrap
import time

from gpu_clocks import ClockSampler, nvidia_smi_index, summarise_clock_lines

# as `nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active
# --format=csv,noheader,nounits` prints them on an H100 (a power-capped stretch: 0x4 and 0x20 reasons), with the
# lines a sampler may also meet: a header, unsupported fields and a line cut when it was stopped
LINES = [
    "clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, clocks_throttle_reasons.active",
    "1980, 2619, 431.20, 48, 0x0000000000000000",
    "1755, 2619, 699.87, 63, 0x0000000000000004",
    "1620, 2619, 700.02, 66, 0x0000000000000024",
    "[N/A], 2619, [N/A], 66, 0x0000000000000000",
    "1710, 2619, 698.50, 67, 0x0000000000000004",
    "1710, 26",
]


def test_summary_of_recorded_lines():
    s = summarise_clock_lines(LINES)
    assert s == {"samples": 4, "sm_mhz_median": (1710 + 1755) / 2, "sm_mhz_min": 1620.0, "sm_mhz_max": 1980.0,
                 "mem_mhz_median": 2619.0, "power_w_median": (698.50 + 699.87) / 2, "power_w_max": 700.02,
                 "temperature_c_max": 67.0, "throttle_reasons": ["0x24", "0x4"]}
    assert summarise_clock_lines(LINES[:1] + LINES[4:5]) is None  # nothing parses: no summary, not zeros
    assert summarise_clock_lines([]) is None


def test_nvidia_smi_index_follows_cuda_visible_devices():
    assert nvidia_smi_index(1, "3,5") == 5
    assert nvidia_smi_index(0, " 2 ") == 2
    assert nvidia_smi_index(1, "") == 1
    assert nvidia_smi_index(0, "GPU-8f2a,GPU-11aa") == 0  # UUIDs: nvidia-smi's order is not known from them
    assert nvidia_smi_index(2, "3,5") == 2  # past the list: left as it is


def test_sampler_reads_what_the_executable_prints(tmp_path):
    """A stand-in for nvidia-smi prints two samples and then waits as nvidia-smi --loop-ms does; the sampler stops it
    at the block's end and summarises its lines; it is given the card and the period asked for."""
    exe = tmp_path / "fake-smi"
    exe.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {tmp_path}/args
        echo "1500, 2619, 650.00, 70, 0x0000000000000020"
        case "$*" in *--loop-ms*) ;; *) exit 0 ;; esac  # the sampler's first, single query
        echo "1600, 2619, 640.00, 71, 0x0000000000000000"
        exec sleep 30
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    with ClockSampler(device_index=3, period_ms=100, exe=str(exe)) as clocks:
        for _ in range(200):  # until the sampling call has started (the child starts asynchronously)
            if (tmp_path / "args").exists() and "--loop-ms" in (tmp_path / "args").read_text():
                break
            time.sleep(0.05)
        time.sleep(0.3)
    s = clocks.summary()
    assert s is not None and s["samples"] == 2 and s["sm_mhz_median"] == 1550.0 and s["throttle_reasons"] == ["0x20"]
    once, loop = (line.split() for line in (tmp_path / "args").read_text().splitlines())
    assert "--id=3" in once and "--format=csv,noheader,nounits" in once and not any("--loop-ms" in a for a in once)
    assert loop == [*once, "--loop-ms=100"]


def test_sampler_takes_the_newer_field_name_where_the_driver_refuses_the_older(tmp_path):
    """A driver that knows the throttle reasons only as ``clocks_event_reasons`` refuses the whole query with the
    older name (nvidia-smi exits non-zero): the sampler asks again with the newer one and samples with it; a driver
    that refuses both leaves the block unsampled."""
    exe = tmp_path / "newer-smi"
    exe.write_text(textwrap.dedent("""\
        #!/bin/sh
        case "$*" in *clocks_throttle_reasons*) echo 'Field "clocks_throttle_reasons.active" is not a valid field' >&2
          exit 2 ;; esac
        echo "1800, 2619, 600.00, 60, 0x0000000000000000"
        case "$*" in *--loop-ms*) exec sleep 30 ;; esac
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    with ClockSampler(exe=str(exe)) as clocks:
        time.sleep(0.5)
    s = clocks.summary()
    assert s is not None and s["sm_mhz_median"] == 1800.0 and s["throttle_reasons"] == []
    never = tmp_path / "old-smi"
    never.write_text("#!/bin/sh\nexit 6\n")
    never.chmod(never.stat().st_mode | stat.S_IXUSR)
    with ClockSampler(exe=str(never)) as clocks:
        pass
    assert clocks.summary() is None


def test_sampler_keeps_every_sample_of_a_long_block(tmp_path):
    """A long block prints more than a pipe holds (64 KiB: ~1,500 lines, 6 minutes at 250 ms); nvidia-smi must not
    stall on a full pipe and lose the block's later samples."""
    exe = tmp_path / "long-smi"
    exe.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in *--loop-ms*) ;; *) echo "1980, 2619, 400.00, 50, 0x0"; exit 0 ;; esac
        i=0
        while [ $i -lt 5000 ]; do echo "1700, 2619, 690.00, 70, 0x0000000000000004"; i=$((i + 1)); done
        touch {tmp_path}/printed
        exec sleep 30
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    with ClockSampler(exe=str(exe)) as clocks:
        for _ in range(400):
            if (tmp_path / "printed").exists():
                break
            time.sleep(0.05)
    s = clocks.summary()
    assert s is not None and s["samples"] == 5000 and s["throttle_reasons"] == ["0x4"]


def test_sampler_without_nvidia_smi_gives_none(tmp_path):
    with ClockSampler(exe=str(tmp_path / "no-such-smi")) as clocks:
        pass
    assert clocks.summary() is None
