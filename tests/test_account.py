"""Each rank's account at the job's end (issue 38): its peak device memory sampled from NVML, its wall and CPU time,
its exit code and cause; a table with -v, a JSON file with --report, and one line when memory limits and peaks are
far apart. On every path with the fake GPU, whose NVML lists each client's memory as the H100's did."""

import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import PATHS, fake, job_argv, settle

from mpsrun.job.account import RankAccount, Report, account_lines, memory_hint, report_path
from mpsrun.mps import usage

pytestmark = pytest.mark.mpiexec

CONTEXT_MIB = 518  # what the fake (as the H100) counts for a client's context
HELD = (100, 300, 700)  # MiB each rank allocates


def _report(path: str, short_tmp) -> dict:
    name = short_tmp / "job.json"
    where = report_path(str(name), per_host=True) if path == "per-node" else str(name)
    with open(where) as text:
        return json.load(text)


def _run(path: str, options: list[str], program: list[str], monkeypatch, short_tmp) -> subprocess.CompletedProcess:
    monkeypatch.setenv("FAKE_NVML_LOOK_LOG", str(short_tmp / "looks"))
    argv = job_argv(path, ["-v", "--report", str(short_tmp / "job.json"), *options], program)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", PATHS)
def test_each_ranks_account_is_in_the_report_and_the_table(fake_gpu, short_tmp, monkeypatch, path):
    """Three ranks holding 100, 300 and 700 MiB: the report names each with its pid, host, GPU, MPS membership, peak
    (allocation plus context, as NVML counts it), wall and CPU time, exit code and cause, and the job's end; -v prints
    the same as a table, a line a rank."""
    program = fake("--hold", "0.5", "--until-looks", "8", "--alloc", ",".join(map(str, HELD)))
    out = _run(path, [], program, monkeypatch, short_tmp)
    assert out.returncode == 0, out.stderr
    report = _report(path, short_tmp)
    assert report["exit_code"] == 0 and report["cause"] == "ok" and report["ended"] >= report["started"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2]
    for account, held in zip(report["ranks"], HELD, strict=True):
        assert account["memory_peak"] == held + CONTEXT_MIB, account
        assert account["gpu"] == 0 and account["mps"] is True and account["exit_code"] == 0
        assert account["host"] == socket.gethostname() and account["pid"] > 0
        assert account["wall"] >= 0.5 and 0 < account["cpu"] < account["wall"] + 5
        assert account["cause"] == "exited with code 0"
    table = [line for line in out.stderr.splitlines() if line.startswith("mpsrun:") and "exited with code 0" in line]
    assert len(table) == 3 and all(f" {held + CONTEXT_MIB} " in line for line, held in zip(table, HELD, strict=True))
    if path != "hosts":  # the job's controller keeps the samples of the ranks on its own host
        sampled = {int(rank) for sample in report["samples"] for rank in sample["memory"]}
        assert sampled == {0, 1, 2} and report["sample_interval"] == usage_interval()
    settle(fake_gpu)


def usage_interval() -> float:
    from mpsrun.runtime.constants import USAGE_INTERVAL

    return USAGE_INTERVAL


@pytest.mark.parametrize("path", PATHS)
def test_the_report_names_the_failing_rank_and_how_the_others_ended(fake_gpu, short_tmp, monkeypatch, path):
    """Rank 1 exits with 7: the report has the job's exit code 7 and summary, rank 1's cause says it failed first,
    and the others were stopped (killed by SIGTERM, or exited as the fake does when stopped)."""
    program = fake("--hold", "30", "--fail-rank", "1", "--exit", "7")
    out = _run(path, [], program, monkeypatch, short_tmp)
    assert out.returncode == 7, out.stderr
    report = _report(path, short_tmp)
    assert report["exit_code"] == 7 and report["cause"] == "rank-failed" and "rank 1" in report["summary"]
    first = report["ranks"][1]
    assert first["exit_code"] == 7 and first["cause"] == "exited with code 7 first", first
    assert all(r["exit_code"] != 0 and r["cause"] for r in (report["ranks"][0], report["ranks"][2]))
    settle(fake_gpu)


def test_without_mps_the_account_still_has_memory_and_time(fake_gpu, short_tmp, monkeypatch):
    """--mps off: no MPS membership to prove (mps is null), but NVML's plain contexts give each rank's peak."""
    program = fake("--hold", "0.5", "--until-looks", "3", "--alloc", "200")
    out = _run("local", ["--mps", "off"], program, monkeypatch, short_tmp)
    assert out.returncode == 0, out.stderr
    ranks = _report("local", short_tmp)["ranks"]
    assert [(r["mps"], r["memory_peak"]) for r in ranks] == [(None, 200 + CONTEXT_MIB)] * 3, ranks
    settle(fake_gpu)


@pytest.mark.parametrize(("limit", "held", "expected"), [
    ("8G", "100", "used at most 618 MiB of their --mem-limit (8G): --mem-limit 1G would leave the rest"),
    ("1G", "500", "peaked within 10% of their --mem-limit (up to 1018 MiB of 1G)"),
])
def test_a_limit_far_from_the_peaks_is_said_in_one_line(fake_gpu, short_tmp, monkeypatch, limit, held, expected):
    """With --mem-limit, ranks that used under a quarter of it, or came within 10% of it, are named in one line
    (without -v too)."""
    monkeypatch.setenv("FAKE_NVML_LOOK_LOG", str(short_tmp / "looks"))
    program = fake("--hold", "0.5", "--until-looks", "8", "--alloc", held)
    out = subprocess.run(job_argv("local", ["--mem-limit", limit], program), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    hints = [line for line in out.stderr.splitlines() if line.startswith("mpsrun: hint:")]
    assert len(hints) == 1 and expected in hints[0] and "rank(s) 0-2" in hints[0], out.stderr
    settle(fake_gpu)


def test_a_report_that_cannot_be_written_is_a_usage_error_before_the_job(fake_gpu, short_tmp):
    """--report into a directory that does not exist (or is a directory): exit 2 with one line, nothing run."""
    for target in (short_tmp / "absent" / "job.json", short_tmp):
        out = subprocess.run(job_argv("local", ["--report", str(target)], [sys.executable, "-c", "pass"]),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--report" in out.stderr, out.stderr


def test_a_report_lost_at_the_end_fails_the_job_as_a_teardown_does(fake_gpu, short_tmp):
    """The report's directory removed while the job ran: the job's end says so in one line and exits 3."""
    folder = short_tmp / "reports"
    folder.mkdir()
    remove = f"import os; os.rmdir({str(folder)!r}) if os.environ['RANK'] == '0' else None"
    out = subprocess.run(job_argv("local", ["--report", str(folder / "job.json")], [sys.executable, "-c", remove]),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stderr.strip() == f"mpsrun: cannot write the report {folder / 'job.json'}: No such file or directory"
    settle(fake_gpu)


def _account(rank: int, peak: int | None, limit: int | None, share: int | None = None) -> RankAccount:
    return RankAccount(rank, "h", 1, 0, True, peak, limit, share, None, 1.0, 0.5, 0, "exited with code 0")


@pytest.mark.parametrize(("accounts", "expected"), [
    ([_account(0, 1000, 1024), _account(1, 100, 1024)], "rank(s) 0 peaked within 10%"),
    ([_account(0, 200, 8192), _account(1, 250, 8192)], "rank(s) 0-1 used at most 250 MiB of their --mem-limit (8G): "
                                                       "--mem-limit 512M would"),
    ([_account(0, 200, 8192), _account(1, 5000, 8192)], ""),  # one rank used much of it: no word
    ([_account(0, 30000, None, 20000), _account(1, 1000, None, 20000)], "rank(s) 0 peaked above their share"),
    ([_account(0, None, 1024)], ""),  # never sampled
])
def test_the_memory_hint_names_the_ranks_it_concerns(accounts, expected):
    """The hint: near the limit first, then limits mostly unused (all ranks), then peaks above an unlimited share."""
    hint = memory_hint(accounts)
    assert hint.startswith(expected) if expected else hint == ""


def test_the_table_has_a_header_and_a_line_a_rank():
    """account_lines: a header, then each rank's cells in order, '-' for what is not known."""
    lines = account_lines([_account(0, 618, None), RankAccount(1, "far", None, None, None, None, None, None, None,
                                                               None, None, None, "ended without reporting")])
    assert lines[0].split()[:3] == ["rank", "host", "pid"] and len(lines) == 3
    assert lines[1].split() == ["0", "h", "1", "0", "yes", "618", "-", "-", "1.00", "0.50", "0", "exited", "with",
                                "code", "0"]
    assert lines[2].split()[:11] == ["1", "far", *["-"] * 9]


def test_samples_are_thinned_to_a_bounded_number(monkeypatch):
    """A long job keeps at most SAMPLES_KEPT samples: beyond, every other is dropped and one in two is kept."""
    monkeypatch.setattr(usage, "SAMPLES_KEPT", 8)
    monkeypatch.setattr(usage.gpu_info, "process_memory", lambda uuid: {10: 5 << 20})
    sampler = usage.UsageSampler(["GPU-x"], keep=True)
    for _ in range(40):
        sampler.sample({10: 0})
    assert len(sampler.samples) <= 8 and sampler.peaks == {0: 5}
    assert all(s.memory == {0: 5} for s in sampler.samples)


def test_a_report_is_written_whole_with_the_users_umask(tmp_path):
    """Report.write: JSON in place of the file (no temporary left beside it), mode as the user's umask makes."""
    target = tmp_path / "r.json"
    old = os.umask(0o027)
    try:
        Report(["x"], 0, "ok", "", 1.0, 2.0, 0.5, [_account(0, 1, None)], [usage.Sample(1.5, {0: 1})]).write(
            str(target))
    finally:
        os.umask(old)
    assert json.loads(target.read_text())["samples"] == [{"time": 1.5, "memory": {"0": 1}}]
    assert oct(target.stat().st_mode & 0o777) == oct(0o640) and os.listdir(tmp_path) == ["r.json"]
