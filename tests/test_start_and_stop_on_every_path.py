"""Starting and stopping on every path: start-up under --timeout, teardown that must finish before the launcher
returns, a second Ctrl-C, early signals, one line per failure, the command line winning.

Each test reproduces a failure once measured on one path or another, against the fake GPU with MPICH's mpiexec.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    MPSRUN,
    PATHS,
    Output,
    control_logs,
    descendants,
    fake,
    handles,
    job_argv,
    mpiexec,
    per_node_ranks,
    remove_kept,
    running,
    settle,
    wait_for,
)
from helpers import mpsrun as run

from mpsrun.runtime.constants import SAME_INTERRUPT

pytestmark = pytest.mark.mpiexec

HYDRA_BANNER = re.compile(r"^(=|\s*=|YOUR APPLICATION|This typically|Please see|\[mpiexec@)")


def ours(stderr):
    """mpsrun's own lines (MPICH's Hydra adds banners of its own when a process is signalled)."""
    return [line for line in stderr.splitlines() if line.strip() and not HYDRA_BANNER.match(line)]


@pytest.mark.parametrize("path", PATHS)
def test_timeout_bounds_start_up_on_every_path(fake_gpu, path):
    """--timeout 1.5 with a daemon that never answers: exit 124 well before the 30 s daemon deadline, on every
    path (per-node and --hosts waited 31-61 s), with at most two lines and nothing left."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    out = subprocess.run(job_argv(path, ["--timeout", "1.5"], ["sleep", "1"], ranks=2), capture_output=True,
                         text=True, timeout=25)
    assert out.returncode == 124, out.stderr
    lines = ours(out.stderr)
    assert 1 <= len(lines) <= 2 and all("timed out" in line or "timeout" in line for line in lines), lines
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["per-node", "hosts"])
@pytest.mark.slow
def test_the_job_returns_after_the_node_teardown(fake_gpu, path):
    """A node keeper whose daemon's quit hangs: the job returns 0 only once the node's session is gone (--hosts
    returned after 6 s with the keeper, daemons and directory still there, and Hydra reporting a SIGTERM), with the
    one line the other paths print about the quit."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    out = subprocess.run(job_argv(path, [], ["true"], ranks=1), capture_output=True, text=True, timeout=120)
    lines = ours(out.stderr)
    assert out.returncode == 0 and len(lines) == 1 and "did not quit in 10 s; terminated" in lines[0], out.stderr
    assert not fake_gpu.session_dirs() and not fake_gpu.orphans()


@pytest.mark.mpiexec
def test_a_supervisor_holds_the_launchers_connection_until_it_ends(fake_gpu):
    """A per-node rank's supervisor, waiting for its node's teardown after its program ended (a quit that hangs),
    still holds the PMI connection MPICH's Hydra handed it, as a plain rank would until its end: Hydra's proxy spun
    a whole core from the moment that connection closed (the supervisor closed its copy once the program had it)."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    job = subprocess.Popen(job_argv("per-node", [], ["true"], ranks=1), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any("Cmd:quit" in p.read_text() for p in fake_gpu.tmpdir.rglob("control.log")),
             what="the program did not end", proc=job)  # the supervisor waits now; the quit hangs for 10 s
    [supervisor] = per_node_ranks(job)
    held = os.readlink(f"/proc/{supervisor.pid}/fd/{supervisor.environ()['PMI_FD']}")
    _, err = job.communicate(timeout=60)
    assert held.startswith("socket:"), held
    assert job.returncode == 0, err
    settle(fake_gpu)


#: Rank 0 ends once rank 1 runs; rank 1 then looks whether rank 0's supervisor is still there a second after rank 0's
#: program has ended, and writes what it saw.
EARLY_AND_LATE = """
import os, sys, time
here = sys.argv[1]
def wait(what):
    for _ in range(3000):
        if what():
            return
        time.sleep(0.02)
    raise SystemExit(f"waited 60 s in vain: {what}")
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
if os.environ["RANK"] == "0":
    wait(lambda: os.path.exists(os.path.join(here, "late")))
    with open(os.path.join(here, "early.tmp"), "w") as out:
        out.write(f"{os.getpid()} {os.getppid()}")
    os.replace(os.path.join(here, "early.tmp"), os.path.join(here, "early"))
else:
    open(os.path.join(here, "late"), "w").close()
    wait(lambda: os.path.exists(os.path.join(here, "early")))
    program, supervisor = map(int, open(os.path.join(here, "early")).read().split())
    wait(lambda: not alive(program))
    time.sleep(1)
    with open(os.path.join(here, "seen"), "w") as out:
        out.write("lingers" if alive(supervisor) else "gone")
"""


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_that_ends_first_leaves_its_launcher_with_the_others(fake_gpu, short_tmp, path):
    """A rank that ends while another of its node runs stays (its supervisor waits) until that one has ended too, so
    that the node's ranks leave their launcher together: MPICH's Hydra spun a whole core from the first exit of its
    processes to the last."""
    out = subprocess.run(job_argv(path, [], [sys.executable, "-c", EARLY_AND_LATE, str(short_tmp)], ranks=2),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (short_tmp / "seen").read_text() == "lingers"
    settle(fake_gpu)


#: An mpiexec whose rank 1 exits 1 after a second, before its supervisor starts (as a supervisor that cannot start).
LOSES_RANK_1 = """import os, sys
real, args = {real!r}, sys.argv[1:]
if args[:1] != ["--version"]:
    args = [*args[:2], sys.executable, {rank!r}, *args[2:]]  # -n N, then the ranks' command
os.execv(real, [real, *args])
"""
RANK_1_LOST = """import os, sys, time
if os.environ.get("PMI_RANK") == "1":
    time.sleep(1)
    sys.exit(1)
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.mpiexec
def test_ranks_done_before_a_lost_one_would_join_do_not_wait_for_it(fake_gpu, short_tmp):
    """Under --launcher mpiexec, a rank lost before its supervisor joins: the ranks already done leave at once, so
    mpiexec ends and the job says which rank never started (exit 1). They waited for the lost one (up to 60 s), and
    mpiexec for them, and mpsrun for mpiexec before it counted the rank as never started."""
    rank = short_tmp / "rank.py"
    rank.write_text(RANK_1_LOST)
    launcher = short_tmp / "mpiexec"
    launcher.write_text(f"#!{sys.executable}\n" + LOSES_RANK_1.format(real=mpiexec(), rank=str(rank)))
    launcher.chmod(0o755)
    out = subprocess.run([*MPSRUN, "-np", "3", "--launcher", "mpiexec", "--mpiexec", str(launcher), "true"],
                         capture_output=True, text=True, timeout=40)
    assert out.returncode == 1 and "before rank(s) 1 started" in out.stderr, out.stderr
    settle(fake_gpu)


IGNORE_TERM = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()\n"
               "time.sleep(120)\n")


def test_a_second_ctrl_c_under_per_node_kills_at_once(fake_gpu, short_tmp):
    """Two SIGINTs a second apart to a per-node rank's mpsrun, whose rank ignores them: killed at once
    (it waited out the whole --grace 60)."""
    job = subprocess.Popen([mpiexec(), "-n", "1", sys.executable, "-m", "mpsrun", "--per-node", "--grace", "60",
                            sys.executable, "-c", IGNORE_TERM, str(short_tmp)], stderr=subprocess.PIPE, text=True)
    err = Output(job.stderr)
    wait_for(lambda: list(short_tmp.iterdir()), what="the rank did not start", proc=job)
    [rank] = per_node_ranks(job)
    rank.send_signal(signal.SIGINT)
    err.wait_for("received SIGINT", proc=job)  # the first one is being acted on: the rank ignores it
    time.sleep(2 * SAME_INTERRUPT)  # the rule is one of time: a SIGINT again within this is the same Ctrl-C
    rank.send_signal(signal.SIGINT)
    job.wait(timeout=30)
    err = err.text()
    assert "second interrupt" in err, err
    settle(fake_gpu)


def test_a_second_ctrl_c_to_every_rank_is_said_once(fake_gpu, short_tmp):
    """Two SIGINTs a second apart to each of three per-node ranks' mpsruns (a terminal's Ctrl-C reaches them all),
    whose ranks ignore them: killed at once, and the second interrupt said once (it was said 2-3 times)."""
    job = subprocess.Popen([mpiexec(), "-n", "3", sys.executable, "-m", "mpsrun", "--per-node", "--grace", "60",
                            sys.executable, "-c", IGNORE_TERM, str(short_tmp)], stderr=subprocess.PIPE, text=True)
    err = Output(job.stderr)
    wait_for(lambda: len(list(short_tmp.iterdir())) == 3, what="the ranks did not start", proc=job)
    ranks = per_node_ranks(job)
    for rank in ranks:
        rank.send_signal(signal.SIGINT)
    err.wait_for("received SIGINT", proc=job)
    time.sleep(2 * SAME_INTERRUPT)  # the rule is one of time: a SIGINT again within this is the same Ctrl-C
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):  # the first one's may end the others
            rank.send_signal(signal.SIGINT)
    job.wait(timeout=30)
    text = err.text()
    assert text.count("second interrupt") == 1, text
    settle(fake_gpu)


def test_a_signal_during_the_imports_is_one_line(fake_gpu):
    """A SIGINT that arrives while the command's modules are still being imported: one line and 130, no
    KeyboardInterrupt traceback (it used to be one within about 0.2 s of the start)."""
    code = ("import os, signal, sys\nimport mpsrun._entry as entry\nos.kill(os.getpid(), signal.SIGINT)\n"
            "sys.argv = ['mpsrun', 'true']\nsys.exit(entry.main())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 130 and out.stderr == "mpsrun: error: interrupted by SIGINT before the job started\n"


def test_an_ignored_hangup_stays_ignored(fake_gpu, short_tmp):
    """Under nohup (SIGHUP inherited as ignored) a SIGHUP does not stop the job."""
    job = subprocess.Popen([*job_argv("local", [], fake("--hold", "3", "--report-dir", str(short_tmp)), ranks=1)],
                           stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP,
                                                                                               signal.SIG_IGN))
    wait_for(lambda: list(short_tmp.glob("*.json")), what="the rank did not start", proc=job)
    job.send_signal(signal.SIGHUP)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    settle(fake_gpu)


def test_an_interrupt_in_per_node_start_up_is_one_line(fake_gpu):
    """SIGTERM to every per-node rank while the node's daemon does not answer: one line for the node, not one per
    rank."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    job = subprocess.Popen([mpiexec(), "-n", "3", sys.executable, "-m", "mpsrun", "--per-node", "true"],
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _starting(fake_gpu, job, 3), what="the per-node ranks did not start", proc=job)
    for proc in descendants(job, "--per-node"):
        with contextlib.suppress(psutil.NoSuchProcess):  # one that failed at once has said so
            proc.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    lines = [line for line in ours(err) if "interrupted" in line]
    assert len(lines) == 1 and "before the ranks started" in lines[0], err
    settle(fake_gpu)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_signal_before_a_per_node_rank_joins_is_the_nodes_line(fake_gpu, local_rank):
    """A SIGTERM that reaches a per-node rank after its entry point took the signals but before its join handles them
    (a rank slower than its node's others: importing the per-node code, or just before it joins) is said as the
    node's interrupt line, by local rank 0 only, exit 143. It was 'mpsrun: error: interrupted by SIGTERM' from every
    such rank, beside the node's line (test_an_interrupt_in_per_node_start_up_is_one_line, now and then under load).
    The signal is sent from where run_per_node would run."""
    code = ("import os, signal, sys, time\nimport mpsrun._entry as entry\nimport mpsrun.agent.pernode as pernode\n"
            "def slow(config, environ=None):\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n"
            "pernode.run_per_node = slow\nsys.argv = ['mpsrun', '--per-node', 'true']\nsys.exit(entry.main())\n")
    env = {**os.environ, "PMI_RANK": str(local_rank), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(local_rank),
           "MPI_LOCALNRANKS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    expected = "mpsrun: interrupted by SIGTERM before the ranks started\n" if local_rank == 0 else ""
    assert out.returncode == 143 and out.stderr == expected, out.stderr


def _starting(fake_gpu, job, ranks):
    """Whether the node's daemon was started (its log is made then) and each of the ``ranks`` per-node mpsrun
    processes under ``job`` has its signal handlers in place: the job is in its start-up, waiting for the daemon."""
    started = [proc for proc in descendants(job, "--per-node") if handles(proc, signal.SIGTERM)]
    return len(started) == ranks and list(fake_gpu.tmpdir.rglob("control.log"))


@pytest.mark.parametrize(("variables", "argv"), [
    ({"MPSRUN_VERBOSE": "1"}, ["-q"]), ({"MPSRUN_QUIET": "1"}, ["-v"]),
    ({"MPSRUN_HOSTS": "nosuchhost"}, ["--hostfile", "HOSTFILE"]),
])
def test_the_command_line_wins_over_an_exclusive_variable(fake_gpu, short_tmp, variables, argv):
    """An MPSRUN_ variable for an option that excludes one given on the command line is ignored (it was exit 2)."""
    hostfile = short_tmp / "hosts"
    hostfile.write_text("localhost\n")
    argv = [str(hostfile) if word == "HOSTFILE" else word for word in argv]
    out = subprocess.run([sys.executable, "-m", "mpsrun", *argv, "--mpiexec", mpiexec(), "-np", "1", "true"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **variables})
    assert out.returncode == 0, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("fault", ["unsafe-root", "daemon-fails"])
def test_a_host_that_cannot_start_is_one_line(fake_gpu, fault):
    """Under --hosts a host's refusal (an unsafe session root, a daemon that fails) is the job's one summary line
    (it was two: the error, then 'mpiexec exited with code 3 before rank(s) 0 started')."""
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    if fault == "unsafe-root":
        root.mkdir(mode=0o755)
        root.chmod(0o755)
    else:
        fake_gpu.daemon_env(FAKE_MPS_START_FAIL="1")
    try:
        out = subprocess.run(job_argv("hosts", [], ["true"], ranks=2), capture_output=True, text=True, timeout=120)
    finally:
        if root.exists():
            root.chmod(0o700)
    assert out.returncode == 3 and len(ours(out.stderr)) == 1, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_killed_node_keeper_is_named(fake_gpu, short_tmp, path):
    """SIGKILL to the node keeper: exit 3 and a line that says so (it was 143 and silence under --per-node); under
    --hosts the job's summary blames the keeper, not the rank's supervisor (a hostile pass saw 'its supervisor is
    gone')."""
    job = subprocess.Popen(job_argv(path, [], fake("--hold", "60", "--report-dir", str(short_tmp)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    keeper = next(p for p in psutil.process_iter(["cmdline"]) if "mpsrun.agent.keeper" in " ".join(p.info["cmdline"] or [])
                  and p.environ().get("MPSRUN_FAKE_NVML") == str(fake_gpu.nvml_dir))
    keeper.kill()
    _, err = job.communicate(timeout=120)
    assert job.returncode == 3 and "died under the job" in err and "supervisor is gone" not in err, err
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_program_that_cannot_be_started_is_named_with_a_pid(fake_gpu, short_tmp, path):
    """A program whose exec fails (its interpreter does not exist: 127; not a program: 126): the summary names the
    rank with the pid of the process that ends with that code, its supervisor, as every other summary names one
    ('rank 0 exited with code 127 first' had none)."""
    for body, code, why in ((b"#!/nonexistent/interpreter\n", 127, "No such file or directory"),
                            (b"\x00\x01 not a program", 126, "Exec format error")):
        program = short_tmp / "program"
        program.write_bytes(body)
        program.chmod(0o755)
        out = subprocess.run(job_argv(path, [], [str(program)], ranks=2), capture_output=True, text=True, timeout=120)
        assert out.returncode == code, out.stderr
        assert re.search(rf"mpsrun: rank \d \(pid \d+\) exited with code {code} first: {program}: {why}", out.stderr), \
            out.stderr
    settle(fake_gpu)


def test_first_comes_before_the_reason(fake_gpu):
    """The summary reads 'rank 0 ... exited with code 127 first: /x: ...' (the reason no longer splits it)."""
    out = subprocess.run(job_argv("per-node", [], [str(Path("/nonexistent/x"))], ranks=1), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 127 and re.search(r"rank 0 .*exited with code 127 first: /nonexistent/x", out.stderr), \
        out.stderr
    settle(fake_gpu)


# -- a third pass -------------------------------------------------------------------------------------------------

MISS = ('import os, sys\nif os.environ["RANK"] == "1": os.environ["CUDA_MPS_PIPE_DIRECTORY"] = "/nonexistent"\n'
        'os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n')


def test_hundreds_of_local_ranks_all_join(fake_gpu):
    """200 local ranks connect to the controller at once (from 130 on they failed: the listen backlog was full
    and connecting gave EAGAIN)."""
    out = subprocess.run(job_argv("local", ["--mps", "off"], ["true"], ranks=200), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    settle(fake_gpu)


def test_a_signal_while_ranks_start_stops_the_job(fake_gpu):
    """SIGTERM while 400 local ranks are still being started: the job stops (it went on starting them all)."""
    job = subprocess.Popen(job_argv("local", ["--mps", "off"], ["sleep", "60"], ranks=400),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: running(job, ["sleep", "60"]), what="no rank started", proc=job, interval=0.005)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=45)
    assert job.returncode == 143 and "stopped by SIGTERM" in err, err[-2000:]
    settle(fake_gpu)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_in_per_node_start_up_leaves_nothing_soon(fake_gpu, sig):
    """Signals to the per-node ranks while their node's daemon does not answer: the keeper gives up at once
    (it stayed with its daemon and directory until its own 30 s start deadline)."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    job = subprocess.Popen(job_argv("per-node", [], ["true"], ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _starting(fake_gpu, job, 2), what="the per-node ranks did not start", proc=job)
    for proc in descendants(job, "--per-node"):
        with contextlib.suppress(psutil.NoSuchProcess):  # Hydra may have ended it with the first one
            proc.send_signal(sig)
    job.communicate(timeout=60)
    settle(fake_gpu, timeout=20.0)  # well before the 30 s start deadline it used to wait out, even on a loaded machine
    assert not fake_gpu.orphans() and not fake_gpu.session_dirs()


@pytest.mark.parametrize("path", PATHS)
def test_a_short_run_without_mps_is_caught(fake_gpu, short_tmp, monkeypatch, path):
    """--mps on and a rank that uses the GPU without MPS for 0.7 s: exit 3 (the check's backoff let it pass). On a
    busy machine the job's looks at NVML come later than their 0.2 s: the rank then stays until NVML's process list
    was read 8 times since its context began (two looks in a row find a rank off MPS; 0.7 s is 3-4 looks). Not 4: the
    memory samples read that list too, and under load 4 reads came before the watch knew the rank (exit 0, once in
    a suite)."""
    monkeypatch.setenv("FAKE_NVML_LOOK_LOG", str(short_tmp / "looks"))
    miss = short_tmp / "miss.py"
    miss.write_text(MISS)
    out = subprocess.run(job_argv(path, ["--mps", "on"], [sys.executable, str(miss),
                                                          *fake("--hold", "0.7", "--until-looks", "8")[1:]]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and "rank 1 (pid" in out.stderr and "without MPS" in out.stderr, out.stderr
    settle(fake_gpu)


def test_a_per_node_warning_reaches_the_user(fake_gpu, short_tmp, monkeypatch):
    """--mps auto, a per-node rank without MPS for 1 s: the warning is printed (it was sent through a rank that was
    ending, and lost). On a busy machine the rank stays until NVML's process list was read 8 times (the watch's
    looks and the memory samples')."""
    monkeypatch.setenv("FAKE_NVML_LOOK_LOG", str(short_tmp / "looks"))
    miss = short_tmp / "miss.py"
    miss.write_text(MISS)
    out = subprocess.run(job_argv("per-node", [], [sys.executable, str(miss),
                                                   *fake("--hold", "1", "--until-looks", "8")[1:]]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "warning: rank 1 (pid" in out.stderr, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_refused_rank_is_said_once(fake_gpu, path):
    """--mem-limit auto with too little memory for 4 ranks: one line on every path (under --hosts it was 4 plus a
    summary)."""
    fake_gpu.set_free_memory(1 << 30)
    out = subprocess.run(job_argv(path, ["--mem-limit", "auto"], ["true"], ranks=4), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert len(ours(out.stderr)) == 1 and "too little for a CUDA context" in out.stderr, out.stderr
    settle(fake_gpu)



@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("option", "words"), [(["--mem-limit", "auto"], "--mem-limit auto: 3 rank(s)"),
                                               (["--thread-percentage", "10,20"], "--thread-percentage lists 2 values")])
def test_a_limit_that_cannot_be_honoured_starts_no_daemon(fake_gpu, path, option, words):
    """--mem-limit auto with too little free memory for 3 ranks, or a --thread-percentage list of 2 for 3 ranks, is
    refused as one error before any MPS daemon starts, on every path (under --per-node and --hosts the node's daemon
    started first, and --hosts said it without "error:")."""
    fake_gpu.set_free_memory(300 << 20)
    out = subprocess.run(job_argv(path, [*option, "--keep-logs"], ["true"], ranks=3),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    said = [line for line in ours(out.stderr) if words in line]
    assert len(said) == 1 and said[0].startswith(f"mpsrun: error: {words}"), out.stderr
    assert control_logs(fake_gpu) == [], "a daemon was started"
    if fake_gpu.session_dirs():
        remove_kept(fake_gpu)
    settle(fake_gpu)

# -- a fourth pass --------------------------------------------------------------------------------------------------


def test_under_hosts_a_variable_does_not_beat_the_command_line(fake_gpu, short_tmp):
    """MPSRUN_MPS=off with --mps auto on the command line under --hosts: the ranks run under MPS (the per-node
    ranks read the variable again, since an option equal to its default is not forwarded)."""
    out = subprocess.run(job_argv("hosts", ["--mps", "auto"], fake("--report-dir", str(short_tmp)), ranks=2),
                         capture_output=True, text=True, timeout=120, env={**os.environ, "MPSRUN_MPS": "off"})
    assert out.returncode == 0, out.stderr
    assert all(json.loads(p.read_text())["mps"] for p in short_tmp.glob("*.json")), out.stderr
    hostfile = short_tmp / "hosts"
    hostfile.write_text("localhost\n")
    out = subprocess.run([sys.executable, "-m", "mpsrun", "--hostfile", str(hostfile), "--mpiexec", mpiexec(), "-np",
                          "2", "true"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MPSRUN_HOSTS": ",,,"})
    assert out.returncode == 0, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize(("np", "said"), [("0", "whole number"), ("3", "-np 3")])
def test_a_per_node_usage_error_is_said_once(fake_gpu, np, said):
    """mpiexec -n 4 mpsrun --per-node -np 0 (a bad value) or -np 3 (not what the launcher started): exit 2 and one
    line (every rank used to say it)."""
    out = subprocess.run([mpiexec(), "-n", "4", sys.executable, "-m", "mpsrun", "--per-node", "-np", np, "true"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len([line for line in ours(out.stderr) if said in line]) == 1, out.stderr


def test_a_session_closed_before_it_started_cannot_start(fake_gpu):
    """s.close() on a session never started, then `with s:`: refused (it used to start the daemons)."""
    from mpsrun import MPSError, mps_session

    session = mps_session()
    session.close()
    with pytest.raises(MPSError, match="this session is closed"), session:
        pass


def test_a_session_not_running_hands_out_nothing(fake_gpu):
    """env() and clients() of a session not started, or closed, raise (they returned {} or deleted paths)."""
    from mpsrun import MPSError, mps_session

    session = mps_session()
    with pytest.raises(MPSError, match="not started"):
        session.env()
    with session:
        assert session.env()
    for call in (session.env, session.clients):
        with pytest.raises(MPSError, match="closed"):
            call()


@pytest.mark.parametrize(("local_rank", "lines"), [("0", 1), ("1", 0)])
def test_an_interrupt_before_a_per_node_start_is_said_once_per_node(local_rank, lines):
    """A stopping signal that reached every per-node rank's mpsrun while it was still importing (noted by the entry
    point, then raised): said by the node's first rank only, exit 130 for each (each of 12 ranks said it)."""
    code = "import sys, signal\nfrom mpsrun.cli import main\nsys.exit(main(['--per-node', 'true'], [signal.SIGINT]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPSRUN_CONTROL")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "MPI_LOCALRANKID": local_rank, "MPI_LOCALNRANKS": "2"})
    assert out.returncode == 130, out.stderr
    assert len(ours(out.stderr)) == lines and out.stderr.count("interrupted by SIGINT") == lines, out.stderr


def test_timeout_bounds_start_up(fake_gpu):
    """--timeout 2 with a daemon that never answers: exit 124 after about 2 s, and the message quotes the log."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    started = time.monotonic()
    out = run("-np", "2", "--launcher", "local", "--timeout", "2", "true")
    assert out.returncode == 124, out.stderr
    assert time.monotonic() - started < 15 and out.stderr.count("\n") == 1
    assert "timed out after 2 s while the MPS daemons started" in out.stderr


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.4])
def test_a_signal_as_a_hosts_job_starts_stops_its_ranks_at_once(fake_gpu, tmp_path, delay):
    """SIGTERM to a --hosts job as it starts reaches its ranks at once (exit 143), well within --grace. Before, a
    signal before the hosts' agents joined was sent to no agent, and one sent with an agent's admission was dropped
    with it: the ranks ran on until twice --grace had passed (found by the hostile pass, 7 of 7 runs)."""
    program = tmp_path / "long.py"
    program.write_text("import time\nfor i in range(600):\n    print(i, flush=True)\n    time.sleep(0.1)\n")
    job = subprocess.Popen(job_argv("hosts", ["-v", "--grace", "60"], [sys.executable, str(program)]),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while "ranks starting" not in job.stderr.readline():
            pass
        time.sleep(delay)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=40)  # the ranks' SIGTERM comes at once, not after --grace 60
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 143, err
    assert "Traceback" not in err
    settle(fake_gpu)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_an_interrupt_during_start_up_is_one_line(fake_gpu, sig, launcher):
    """A signal while the daemon starts (one that never answers): one line, exit 128+N, nothing left."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    where = ["--mpiexec", shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"] \
        if launcher == "mpiexec" else []
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", launcher, *where, "true"],
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: list(fake_gpu.tmpdir.rglob("control.log")), proc=job)  # the daemon was started
    job.send_signal(sig)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 128 + sig
    assert err == f"mpsrun: error: interrupted by {signal.Signals(sig).name}\n"
    wait_for(lambda: not fake_gpu.session_dirs() and not fake_gpu.orphans())
