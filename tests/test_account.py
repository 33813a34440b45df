"""Each rank's account at the job's end (issue 38): its peak device memory sampled from NVML, its wall and CPU time,
its exit code and cause; a table with -v, a JSON file with --report, and one line when memory limits and peaks are
far apart. On every path with the fake GPU, whose NVML lists each client's memory as the H100's did."""

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPSRUN, PATHS, fake, job_argv, run_job, settle, wait_for

from mpsrun.agent.account import RankAccount, Report, account_lines, memory_hint, report_path
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


def _job(options: list[str], program: list[str], path: str = "local", ranks: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(job_argv(path, options, program, ranks=ranks), capture_output=True, text=True, timeout=120)


def test_a_report_through_a_symlink_writes_its_target(fake_gpu, short_tmp):
    """--report LINK where LINK is a symlink to reports/job.json (a 'latest' link a batch script keeps): the report
    must reach the file the user named through the link, as any program's output file does. mpsrun instead renames a
    new file over the link: the link is gone and its target never written."""
    reports = short_tmp / "reports"
    reports.mkdir()
    target, link = reports / "job.json", short_tmp / "latest.json"
    link.symlink_to(target)
    out = _job(["--report", str(link)], [sys.executable, "-c", "pass"])
    assert out.returncode == 0, out.stderr
    assert link.is_symlink(), "the user's symlink was replaced by a regular file"
    assert target.exists() and json.loads(target.read_text())["exit_code"] == 0
    settle(fake_gpu)


def test_a_report_to_a_fifo_reaches_its_reader(fake_gpu, short_tmp):
    """--report FIFO with a reader on it (`mkfifo r; jq . r & mpsrun --report r ...`, the way a batch script streams
    sacct-like output): the reader must get the report, or mpsrun must refuse the path in one line. mpsrun instead
    replaces the FIFO with a regular file: the reader never gets anything and waits for ever."""
    fifo = short_tmp / "report.fifo"
    os.mkfifo(fifo)
    received = short_tmp / "received"
    with open(received, "wb") as sink:
        reader = subprocess.Popen(["cat", str(fifo)], stdout=sink)
    try:
        out = _job(["--report", str(fifo)], [sys.executable, "-c", "pass"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            reader.wait(timeout=10)
        still_fifo = os.path.exists(fifo) and os.stat(fifo, follow_symlinks=False).st_mode & 0o170000 == 0o010000
    finally:
        if reader.poll() is None:
            reader.kill()  # our own cat, blocked on a FIFO no one will open any more
            reader.wait()
    assert still_fifo, "the FIFO was replaced by a regular file"
    assert out.returncode == 0 and json.loads(received.read_text())["exit_code"] == 0, (out.stderr,
                                                                                      received.read_text())
    settle(fake_gpu)


@pytest.mark.parametrize("signalled", [False, True], ids=["waited", "sigterm"])
def test_a_report_into_a_fifo_whose_reader_reads_nothing_ends_the_job(fake_gpu, short_tmp, signalled):
    """--report FIFO whose reader holds it open and reads nothing, and a report larger than a pipe holds (64 KiB: a
    long command line here, 300 ranks in the issue): command-line.md says a FIFO no one reads is exit 3, not a wait.
    The job ends with one line and exit 3 within seconds; a SIGTERM meanwhile is one while the job ends (said so, in a
    line of its own). mpsrun waited for ever, and SIGTERM then ended it with 'error: interrupted by SIGTERM'."""
    fifo = short_tmp / "report.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
    try:
        job = subprocess.Popen([*MPSRUN, "-np", "1", "--launcher", "local", "--report", str(fifo), "true", "x" * 100000],
                               stderr=subprocess.PIPE, text=True)
        if signalled:  # once the report is being written: the pipe has something in it
            wait_for(lambda: select.select([reader], [], [], 0.1)[0], timeout=60, what="the report's start", proc=job)
            job.send_signal(signal.SIGTERM)
        try:
            _, err = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()
            pytest.fail("mpsrun still wrote into a FIFO no one read after 60 s")
    finally:
        os.close(reader)
    lines = err.splitlines()
    assert job.returncode == 3 and lines[0] == f"mpsrun: cannot write the report {fifo}: a FIFO whose reader took " \
        "nothing for 2 s", err
    assert lines[1:] == (["mpsrun: interrupted by SIGTERM while ending the job"] if signalled else []), err
    settle(fake_gpu)


def test_a_report_to_a_full_device_is_one_line_and_exit_3(fake_gpu, short_tmp):
    """--report onto a device that refuses every write (a char device 1:7, what /dev/full is): command-line.md
    promises that a report that cannot be written at the end is one line and exit 3. mpsrun instead renames a new
    file over the device node (as root, `--report /dev/full` or `--report /dev/stdout` would replace /dev's own) and
    exits 0."""
    full = short_tmp / "full"
    try:
        os.mknod(full, 0o020666, os.makedev(1, 7))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    out = _job(["--report", str(full)], [sys.executable, "-c", "pass"])
    assert os.stat(full, follow_symlinks=False).st_mode & 0o170000 == 0o020000, "the device node was replaced"
    assert out.returncode == 3 and out.stderr.count("\n") == 1, (out.returncode, out.stderr)
    assert out.stderr.startswith(f"mpsrun: cannot write the report {full}: No space left on device"), out.stderr
    settle(fake_gpu)


def test_a_per_node_report_onto_a_device_is_written_there_and_nothing_beside_it(fake_gpu, short_tmp):
    """A bare --per-node job's --report onto a device (a char device 1:7, what /dev/full is) is written as it stands,
    as on the other paths: the node says in one line that it cannot, with the job's exit code. Each node wrote a new
    regular file beside it instead (FILE.HOST: as root, /dev/full.node01 in /dev) and said nothing."""
    full = short_tmp / "full"
    try:
        os.mknod(full, 0o020666, os.makedev(1, 7))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    out = run_job("per-node", ["--report", str(full)], ["true"], ranks=2)
    assert sorted(p.name for p in short_tmp.iterdir()) == ["full"]
    assert out.returncode == 0 and out.stderr.count(f"cannot write the report {full}: No space left") == 1, out.stderr
    settle(fake_gpu)


def test_a_job_whose_launcher_fails_before_any_rank_starts_lists_them_as_never_started(fake_gpu, short_tmp):
    """mpiexec (/bin/false) ends before either rank started: mpsrun says so, and the report lists both ranks as never
    started, with the job's exit code and summary (a batch script always finds one once the job ran)."""
    report = short_tmp / "job.json"
    argv = [*MPSRUN, "-np", "2", "--launcher", "mpiexec", "--mpiexec", "/bin/false", "--report", str(report),
            sys.executable, "-c", "pass"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "before rank(s) 0-1 started" in out.stderr, out.stderr
    written = json.loads(report.read_text())
    assert written["exit_code"] == out.returncode and "before rank(s) 0-1 started" in written["summary"]
    assert [(r["rank"], r["pid"], r["cause"]) for r in written["ranks"]] == [
        (0, None, "ended without reporting (never started)"), (1, None, "ended without reporting (never started)")]
    settle(fake_gpu)


def test_a_report_name_with_a_newline_fails_in_one_line(fake_gpu, short_tmp):
    """A --report path with a newline in it (odd, but a legal file name): each failure is one line (exit 2 when its
    directory is missing at the start, exit 3 when it is gone at the end). mpsrun prints the name raw, so its message
    spans two lines, the second one whatever the name says."""
    start = _job(["--report", str(short_tmp / "absent\nmpsrun: all good" / "job.json")], [sys.executable, "-c", "pass"])
    folder = short_tmp / "d"
    folder.mkdir()
    remove = f"import os; os.rmdir({str(folder)!r}) if os.environ['RANK'] == '0' else None"
    end = _job(["--report", str(folder / "job\nmpsrun: all good.json")], [sys.executable, "-c", remove])
    assert start.returncode == 2 and start.stderr.count("\n") == 1, start.stderr
    assert end.returncode == 3 and end.stderr.count("\n") == 1, end.stderr
    settle(fake_gpu)


def test_hosts_accounts_say_mps_as_the_nodes_verified_line_does(fake_gpu, short_tmp):
    """Under --hosts, rank 1 fails at once and the others are stopped: the node's -v line says '3 of 3 ranks
    connected to MPS', so each rank's account (table and --report) must say mps yes/true. The node keeper builds a
    rank's account when the rank ends, before its client watch settles; a rank stopped quickly is then sent up as
    not known ('-', null), contradicting the line above it. (Timing-dependent: tried twice.)"""
    program = fake("--hold", "30", "--fail-rank", "1", "--exit", "7")
    seen = []
    for attempt in range(2):
        report = short_tmp / f"job{attempt}.json"
        out = _job(["-v", "--report", str(report)], program, path="hosts", ranks=3)
        assert out.returncode == 7, out.stderr
        if "3 of 3 ranks connected to MPS" not in out.stderr:
            continue
        seen.append([r["mps"] for r in json.loads(report.read_text())["ranks"]])
        settle(fake_gpu)
    assert seen and all(mps == [True, True, True] for mps in seen), seen


def test_a_per_node_report_comes_when_the_launcher_ended_every_rank(fake_gpu, short_tmp):
    """A bare --per-node job in which rank 1's mpsrun is killed (SIGKILL; Hydra then ends every rank): the node
    closes after the launcher has returned, and its FILE.HOST.json comes within seconds, with every rank, rank 1
    lost without a report (as command-line.md says)."""
    from mpsrun.agent.account import report_path

    kill = ("import os, signal, time\nif os.environ['RANK'] == '1':\n    time.sleep(1)\n"
            "    os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(5)")
    report = Path(report_path(str(short_tmp / "job.json"), per_host=True))
    out = _job(["--report", str(short_tmp / "job.json")], [sys.executable, "-c", kill], path="per-node", ranks=3)
    assert out.returncode != 0
    written = wait_for(lambda: report.exists() and json.loads(report.read_text()), timeout=60, what="the report")
    assert [r["rank"] for r in written["ranks"]] == [0, 1, 2] and written["ranks"][1]["exit_code"] is None, written
    settle(fake_gpu)


def test_the_near_limit_hint_gives_a_limit_that_fits():
    """command-line.md: where ranks peaked within 10% of their --mem-limit, 'one line says so, with a limit that
    fits'. The line for ranks near their limit says only 'give them more', with no --mem-limit to give."""
    from mpsrun.agent.account import RankAccount, memory_hint

    accounts = [RankAccount(r, "h", 1, 0, True, 1018, 1024, None, None, 1.0, 0.5, 0, "exited with code 0")
                for r in range(3)]
    hint = memory_hint(accounts)
    assert "peaked within 10%" in hint
    import re

    suggested = re.search(r"--mem-limit (\d+)([MG])\b(?! \()", hint.split("):", 1)[-1])
    assert suggested, hint
    assert int(suggested.group(1)) * (1024 if suggested.group(2) == "G" else 1) > 1018, hint


def test_the_share_hint_is_said_under_hosts_as_on_the_other_paths(fake_gpu, short_tmp, monkeypatch):
    """Two ranks share the 80 GiB GPU without --mem-limit and rank 0 peaks at 41518 MiB, above its share (40960):
    with -v, command-line.md promises one hint line, and the local, mpiexec and per-node paths print it. Under
    --hosts the node keeper's relayed account carries no share (RankAccount.relayed sets memory_share None), so the
    line never comes."""
    monkeypatch.setenv("FAKE_NVML_LOOK_LOG", str(short_tmp / "looks"))
    program = fake("--hold", "0.5", "--until-looks", "8", "--alloc", "41000,100")
    out = _job(["-v"], program, path="hosts", ranks=2)
    assert out.returncode == 0, out.stderr
    hints = [line for line in out.stderr.splitlines() if line.startswith("mpsrun: hint:")]
    assert len(hints) == 1 and "rank(s) 0 peaked above their share" in hints[0], out.stderr
    settle(fake_gpu)
