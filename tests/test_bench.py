"""Unit tests of mpsrun bench's arithmetic and options; the GPU tier runs it for real."""

import json
import subprocess
import sys

import pytest
from helpers import MPSRUN, mpsrun

from mpsrun.tools.bench import BenchRow, _rank_list, format_table, main

META = {"gpu": "H100", "driver": "580", "cuda": "13.0", "kernel": "k", "launches_per_rank": 20, "repeats": 3}


def test_ratios_and_table():
    """Speedup is time-sliced/MPS, efficiency one-process/MPS, and the table shows both per row."""
    row = BenchRow(8, {"timesliced": 2.0, "mps": 0.5, "reference": 0.4}, {})
    assert row.speedup == 4.0 and row.efficiency == pytest.approx(0.8)
    table = format_table([row], META)
    assert "    8       2.000s    0.500s       0.400s    4.00x        0.80" in table
    assert table.splitlines()[0].startswith("GPU: H100 (driver 580, CUDA 13.0)")


@pytest.mark.parametrize("bad", ["0", "a", "1,,2", ""])
def test_rank_list_rejects_bad_values(bad):
    """--ranks takes positive integers only."""
    with pytest.raises(Exception, match="positive integers"):
        _rank_list(bad)


def test_bench_option_errors_exit_2(capsys):
    """A bad bench option is a usage error (argparse exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["--ranks", "x"])
    assert info.value.code == 2


@pytest.mark.gpu
def test_bench_prints_its_table():
    """GPU tier: mpsrun bench runs every mode and prints the table with speedup and efficiency."""
    out = subprocess.run([sys.executable, "-m", "mpsrun", "bench", "--ranks", "1,4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split()[:2] == ["ranks", "time-sliced"]
    assert [line.split()[0] for line in lines[2:4]] == ["1", "4"]
    print(out.stdout)


def test_plot_writes_a_png(tmp_path):
    """--plot draws the three curves into a PNG file (when matplotlib is installed)."""
    pytest.importorskip("matplotlib")
    from mpsrun.tools.bench import plot

    rows = [BenchRow(n, {"timesliced": 0.16 * n, "mps": 0.16, "reference": 0.16}, {}) for n in (1, 2, 4)]
    target = tmp_path / "bench.png"
    plot(rows, str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_help_is_plain_text():
    """``bench --help`` shows no reStructuredText markup (it showed ````mpsrun bench````)."""
    out = mpsrun("bench", "--help")
    assert out.returncode == 0 and "``" not in out.stdout and "--repeats" in out.stdout


def test_bench_without_cupy_says_so_in_one_line(fake_gpu):
    """With a GPU and MPS but no CuPy, ``bench`` names the missing package in one line (no traceback of the
    calibration's child process)."""
    code = ("import sys; sys.modules['cupy'] = None; from mpsrun.tools.bench import main; "
            "sys.exit(main(['--json']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert out.stderr.count("\n") == 1 and "bench needs CuPy" in out.stderr, out.stderr
    assert "needs CuPy" in json.loads(out.stdout)["error"]


def test_bench_without_a_gpu_says_so_in_one_line(no_gpu):
    """``mpsrun bench`` without a driver: one line and exit 3; with ``--json`` the reason is on stdout too
    (it was a traceback, and --json printed nothing)."""
    for argv in (["bench"], ["bench", "--json"]):
        out = mpsrun(*argv)
        assert out.returncode == 3, out.stderr
        assert out.stderr.count("\n") == 1 and "bench needs an NVIDIA GPU" in out.stderr, out.stderr
    assert "bench needs an NVIDIA GPU" in json.loads(out.stdout)["error"]


@pytest.mark.parametrize("option", [["--repeats", "0"], ["--repeats", "-1"], ["--kernel-ms", "-5"],
                                    ["--launches", "0"], ["--kernel-ms", "nan"]])
def test_bench_refuses_values_that_cannot_measure(no_gpu, option):
    """``mpsrun bench --repeats 0`` reached statistics.median([]); every non-positive value is a usage error."""
    out = subprocess.run([*MPSRUN, "bench", *option], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be a positive" in out.stderr, out.stderr
