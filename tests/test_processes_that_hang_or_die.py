"""Daemons, node keepers and rank supervisors that hang or die under a job: hanging quits waited out together, a
daemon that dies said once, a stopped keeper or supervisor bounded by --timeout, a stopped daemon that must not
turn a timeout into a rank's failure, a Ctrl-C that must not cut a daemon's quit, and signals while a quit hangs
(a second Ctrl-C included) that leave nothing behind. Each was once measured.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import (
    MPSRUN,
    PATHS,
    Output,
    control_logs,
    daemon_session,
    descendants,
    fake,
    job_argv,
    per_node_ranks,
    settle,
    wait_for,
    wait_processes_gone,
    wait_ready,
)


@pytest.mark.slow
@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
@pytest.mark.parametrize("path", PATHS)
def test_hanging_quits_are_waited_out_together_and_said_once(fake_gpu, path):
    """Two GPUs whose daemons' quit hangs, after every rank succeeded, under --timeout 9: exit 0 (--hosts exited 124,
    the job's timeout firing while the hosts tore down) and one line naming both daemons, on every path, and both
    daemons were sent quit together, as their kept logs show (they were stopped one after another, 10 s apart, each
    said in a line of its own; per-node and --hosts said nothing, their keepers' warnings went to the keepers'
    logs). Slow on purpose: a hanging quit is waited out."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    out = subprocess.run(job_argv(path, ["--gpus", "all", "--keep-logs", "--timeout", "9"], ["true"], ranks=2),
                         capture_output=True, text=True, timeout=120)
    quits = [line for line in out.stderr.splitlines() if "did not quit" in line]
    assert out.returncode == 0, out.stderr
    assert len(quits) == 1 and re.search(r"MPS control daemons \d+, \d+ did not quit in 10 s", quits[0]), out.stderr
    wait_processes_gone(fake_gpu)
    logs = [log.read_text() for root in fake_gpu.session_dirs() for log in root.glob("gpu*/log/control.log")]
    stamps = [datetime.datetime.fromisoformat(match) for log in logs
              for match in re.findall(r"\[(\S+ \S+) Control +\d+\] Cmd:quit", log)]
    for root in fake_gpu.session_dirs():
        shutil.rmtree(root)
    assert len(stamps) == 2 and abs((stamps[0] - stamps[1]).total_seconds()) < 5, logs  # (one after another: >= 10)
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_daemon_that_dies_under_the_job_is_said_once(fake_gpu, short_tmp, path):
    """The daemon SIGKILLed under a running job: exit 3 and one line saying so, on every path (per-node and --hosts
    added an 11-line block of the daemon's log after it)."""
    job = subprocess.Popen(job_argv(path, ["--grace", "1"], fake("--report-dir", str(short_tmp), "--hold", "60"),
                                    ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 2, 60, "the ranks did not start", proc=job)
    root = daemon_session(fake_gpu)
    daemon = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 3, err
    said = [line for line in err.splitlines() if line.startswith("mpsrun") and "daemon" in line]
    assert len(said) == 1 and "died under the job" in said[0], err  # the ranks say what CUDA told them
    assert not [line for line in err.splitlines() if line.startswith("[20")], err  # no block of the daemon's log
    settle(fake_gpu)


def _node_keeper(fake_gpu) -> psutil.Process:
    """The node keeper of this fake machine's job."""
    return next(p for p in psutil.process_iter(["cmdline"]) if "mpsrun.agent.keeper" in " ".join(p.info["cmdline"] or [])
                and p.environ().get("MPSRUN_FAKE_NVML") == str(fake_gpu.nvml_dir))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_stopped_node_keeper_cannot_outlast_the_timeout(fake_gpu, short_tmp, path):
    """A node keeper stopped (SIGSTOP) while its ranks run: --timeout still ends the job, with 124 and one line,
    once the controller's own way (SIGTERM, --grace, its verdict) is overdue (it hung until killed, over 60 s). Slow
    on purpose: the supervisors give the keeper --grace and 10 s more before they act on their own. The timeout leaves
    the ranks time to start under load (with 2 s, --hosts timed out before its ranks ran, on a loaded CI machine)."""
    options = ["--timeout", "8", "--grace", "0.5"]
    job = subprocess.Popen(job_argv(path, options, fake("--hold", "60", "--report-dir", str(short_tmp)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    keeper = _node_keeper(fake_gpu)
    keeper.suspend()
    try:
        _, err = job.communicate(timeout=60)
    finally:
        keeper.resume()  # it then finds its ranks gone and ends its session
    lines = [line for line in err.splitlines() if line.startswith("mpsrun")]
    assert job.returncode == 124 and 1 <= len(lines) <= 2 and all("time" in line for line in lines), err
    assert "timed out after 8 s" in err, err
    settle(fake_gpu)


def _ended(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # its stopped parent has not reaped it
    return True


@pytest.mark.slow
@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_stopped_rank_supervisor_does_not_keep_its_program_past_the_timeout(fake_gpu, short_tmp, path):
    """A rank's own mpsrun stopped (SIGSTOP) under --timeout, its program ignoring SIGTERM: the program still ends
    after --grace (its controller kills its process group, not only asks its supervisor), and once the supervisor
    is continued the job ends with 124 (the program ran on until it finished by itself: 60 s here, forever for
    some). The stopped supervisor itself holds the launcher until continued, as any stopped process does."""
    report = f"os.path.join({str(short_tmp)!r}, os.environ['RANK'])"  # written whole, then named .json
    program = ("import json, os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               f"open({report} + '.tmp', 'w').write(json.dumps({{'pid': os.getpid()}})); "
               f"os.replace({report} + '.tmp', {report} + '.json'); time.sleep(60)")
    job = subprocess.Popen(job_argv(path, ["--timeout", "8", "--grace", "0.5"], [sys.executable, "-c", program],
                                    ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    programs = [json.loads(report.read_text())["pid"] for report in short_tmp.glob("*.json")]
    stopped = per_node_ranks(job)[0]
    stopped.suspend()
    try:
        wait_for(lambda: all(_ended(pid) for pid in programs), 40, "a program outlived its stopped supervisor")
    finally:
        stopped.resume()
    _, err = job.communicate(timeout=60)
    assert job.returncode == 124 and "timed out after 8 s" in err, err
    settle(fake_gpu)


@pytest.mark.slow
@pytest.mark.parametrize("fake_gpu", [1, 2], indirect=True)
@pytest.mark.parametrize("path", ["local"])  # the path that failed (mpiexec, per-node and --hosts gave 124)
def test_a_stopped_daemon_cannot_turn_a_timeout_into_a_rank_failure(fake_gpu, short_tmp, path):
    """The MPS daemons stopped (SIGSTOP) while ranks run under --timeout, on one GPU or two: the job still ends with
    124 (the local launcher exited 1, 'rank 1 exited with code 1 first': its loop was held up by the daemon's silence
    past the deadline, and the ranks' ends came before its timer), saying the timeout once and the silence once. No
    more commands go to a daemon that left one unanswered (each waited out its own 10 s: the job took 32 s, with 4
    lines); the watch's commands, in the controller's loop, wait 2 s (with two GPUs they held the loop past the
    ranks' supervisors' backstop, and the timeout was said twice). Slow on purpose: the first unanswered command
    waits out its deadline. The timeout leaves the ranks time to start under load; the fake ranks' kernels run on, as
    a real rank's do on its server, which the daemon's stop does not stop."""
    job = subprocess.Popen(job_argv(path, ["--timeout", "8", "--grace", "0.5", "--gpus", "all"],
                                    fake("--hold", "30", "--report-dir", str(short_tmp)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    daemons = [p for p in descendants(job, "nvidia-cuda-mps-control") if p.cmdline()[-1] == "-f"]
    for daemon in daemons:
        daemon.suspend()
    try:
        _, err = job.communicate(timeout=120)
    finally:
        for daemon in daemons:
            with contextlib.suppress(psutil.Error):
                daemon.resume()
    lines = [line for line in err.splitlines() if line.startswith("mpsrun")]
    assert job.returncode == 124 and len(daemons) == len(fake_gpu.uuids), err
    assert "timed out after 8 s" in err and "first" not in err and "supervisors did" not in err, err
    assert err.count("timed out after") == 1 and err.count("stopped answering") <= 1, err
    assert len(lines) <= 3 and "did not quit" not in err, err  # its silence is said once, not again at its quit
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_a_ctrl_c_to_the_group_does_not_cut_the_daemons_quit(fake_gpu, path):
    """A Ctrl-C reaches a terminal's whole foreground group. One that came while mpsrun's ``quit`` command ran killed
    that command before the daemon had it: the teardown then waited out its 10 s and terminated the daemon. The
    control commands now run in a session of their own: the job ends with 130 and one line, at once. (Under
    --per-node and --hosts the commands come from the node keepers, which had sessions of their own already.)"""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_CLIENT_WAIT="4")  # (the Ctrl-C must come while it runs)
    job = subprocess.Popen(job_argv(path, ["-v"], ["true"], ranks=2), stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own group, as a terminal's foreground job
    output = Output(job.stderr)
    output.wait_for("mpsrun: ranks done", 60, proc=job)  # the teardown's commands from here on: quit

    def quit_client() -> bool:
        with contextlib.suppress(psutil.Error):
            return any(not {"-f", "--server"} & set(p.cmdline()) for p in descendants(job, "nvidia-cuda-mps-control"))
        return False

    wait_for(quit_client, 60, "no quit command ran", proc=job)
    os.killpg(job.pid, signal.SIGINT)
    job.wait(timeout=60)
    err = output.text()
    assert job.returncode == 130, err
    assert "did not quit" not in err and "interrupted by SIGINT while ending the job" in err, err
    settle(fake_gpu)


@pytest.mark.slow
def test_a_second_ctrl_c_during_teardown_leaves_nothing(fake_gpu, short_tmp):
    """A second SIGINT while the job tears down (quit waits for a client): one line, 130, nothing left."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    job = subprocess.Popen([*MPSRUN, "-np", "4", "--launcher", "local", "--grace", "1", "--tag-output",
                            sys.executable, str(fake_gpu.client_command()[1]), "--hold", "60", "--report-dir",
                            str(short_tmp)], stderr=subprocess.PIPE, text=True)
    wait_ready(short_tmp, count=4, proc=job)
    job.send_signal(signal.SIGINT)
    wait_for(lambda: any("Cmd:quit" in log for log in control_logs(fake_gpu)), what="the teardown did not start",
             proc=job)  # its quit hangs, waiting for a client
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130, err
    ours = [line for line in err.splitlines() if not line.startswith("[rank ")]  # a rank's own KeyboardInterrupt
    assert not any("Traceback" in line for line in ours), err
    settle(fake_gpu)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.slow
def test_a_signal_while_quit_hangs_leaves_nothing(fake_gpu, sig):
    """SIGTERM or SIGHUP while the daemon's quit hangs at teardown: teardown finishes (bounded), nothing is left."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    job = subprocess.Popen([*MPSRUN, "-np", "1", "--launcher", "local", "true"], stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any("Cmd:quit" in log for log in control_logs(fake_gpu)), what="the teardown did not start",
             proc=job)  # the quit client is running, and hangs
    job.send_signal(sig)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 128 + sig and "Traceback" not in err, err
    settle(fake_gpu)


def test_daemon_killed_under_a_running_job(fake_gpu, short_tmp):
    """Killing the daemon under a running job fails the job and the summary says the daemon stopped."""
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "--grace", "1",
                            *fake("--report-dir", str(short_tmp), "--hold", "60")],
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 2)
    [root] = fake_gpu.session_dirs()
    daemon_pid = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon_pid, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert job.returncode != 0
    assert "MPS control daemon" in err and ("died under the job" in err or "stopped" in err)
