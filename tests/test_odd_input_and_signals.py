"""Odd input and interrupts at awkward moments, through the real mpsrun executable against the fake GPU.

Every case: one line and the documented exit code, never a traceback, and nothing left behind
(the fake_gpu fixture checks processes and session directories after each test).
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import MPSRUN, control_logs, job_argv, settle, wait_for, wait_processes_gone, wait_ready
from helpers import mpsrun as run
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


def test_a_closed_stdout_is_no_traceback(fake_gpu):
    """`mpsrun --tag-output ... | head -1`: the reader goes away; no traceback, the job ends, nothing is left."""
    job = subprocess.Popen([*MPSRUN, "-np", "2", "--launcher", "local", "--tag-output", sys.executable, "-c",
                            "import itertools\nfor i in itertools.count(): print(i, flush=True)"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline().startswith("[rank ")
    job.stdout.close()
    _, err = job.communicate(timeout=60)
    ours = [line for line in err.splitlines() if not line.startswith("[rank ")]  # a Python rank's own EPIPE is its own
    assert not any("Traceback" in line for line in ours), err
    settle(fake_gpu)


def test_an_endless_line_keeps_memory_bounded(fake_gpu):
    """A rank writing 100 MB with no newline under --tag-output: no process of the job grows past 150 MB."""
    code = "import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))\nsys.stdout.flush()"
    job = subprocess.Popen([*MPSRUN, "-np", "1", "--launcher", "local", "--tag-output", sys.executable, "-c", code],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    while job.poll() is None:
        for proc in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.Error:
                continue
        job.stdout.read(1 << 22)
    job.communicate(timeout=60)
    assert job.returncode == 0 and peak < 150 << 20, peak


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


def test_timeout_bounds_start_up(fake_gpu):
    """--timeout 2 with a daemon that never answers: exit 124 after about 2 s, and the message quotes the log."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    started = time.monotonic()
    out = run("-np", "2", "--launcher", "local", "--timeout", "2", "true")
    assert out.returncode == 124, out.stderr
    assert time.monotonic() - started < 15 and out.stderr.count("\n") == 1
    assert "timed out after 2 s while the MPS daemons started" in out.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["-np", "\u0663", "true"], "whole number"),
    (["--thread-percentage", "1e2", "true"], "whole number from 1 to 100"),
    (["--mem-limit", "99999999999999999999999T", "true"], "between 1M and 1024T"),
    (["--hosts", "a", "--hostfile", "/etc/hostname", "true"], "not both"),
])
def test_quirky_values_are_refused(fake_gpu, argv, message):
    """Values once accepted or rounded silently are refused in one line with exit 2."""
    out = run(*argv)
    assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_grace_zero_in_any_spelling(fake_gpu):
    """--grace 0 and --grace 0.00 mean the same."""
    for value in ("0", "0.00"):
        assert run("--launcher", "local", "--grace", value, "true").returncode == 0


def test_options_without_effect_say_so(fake_gpu):
    """--thread-percentage, --mem-limit and --priority under --mps off are warned about, not dropped silently."""
    out = run("--launcher", "local", "--mps", "off", "--thread-percentage", "50", "--mem-limit", "1G", "true")
    assert out.returncode == 0
    assert "--thread-percentage, --mem-limit have no effect without MPS" in out.stderr


def test_an_ambiguous_gpu_uuid_prefix_is_refused(fake_gpu):
    """A UUID prefix that names several GPUs is refused (it used to pick the first)."""
    fake_gpu.gpus.append({**fake_gpu.gpus[0], "uuid": "GPU-00000000-fake-second"})
    (fake_gpu.nvml_dir / "gpus.json").write_text(__import__("json").dumps(fake_gpu.gpus))
    out = run("--launcher", "local", "--gpus", "GPU-0000", "true")
    assert out.returncode == 2 and "names 2 GPUs" in out.stderr


_WORDS = st.sampled_from(["-np", "2", "3", "--launcher", "local", "--mps", "off", "auto", "--tag-output", "--grace",
                          "0", "--timeout", "9", "--gpus", "0", "all", "--thread-percentage", "auto", "50,50",
                          "--map-by", "round-robin", "--mem-limit", "1G", "-v", "-q", "--", "-m", "true", "false",
                          "nosuchprogram", "--keep-logs", "--priority", "1"])


@pytest.mark.timeout(300)  # 15 jobs: about 60 s beside the other tests, more on a loaded machine
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(_WORDS, st.text(max_size=8)), max_size=8))
@example(words=["-m"])  # found in CI: `mpsrun -m true`, a rank's own ImportError traceback
@example(words=["timeout"])  # found in a fresh run: coreutils' `timeout true` exits 125, the rank's own code
@pytest.mark.slow
def test_any_command_line_gives_a_documented_code(fake_gpu, words):
    """Whatever the command line (with a fast command at the end), mpsrun exits 0, 2, the rank's own code, 126 or
    127, with no traceback of its own and nothing left behind. The ranks' output is tagged, so a rank's own
    traceback (`-m true`: Python's runner finds no module `true`) is told apart."""
    words = [w for w in words if "\x00" not in w]
    out = subprocess.run([*MPSRUN, "--tag-output", *words, "true"], capture_output=True, timeout=120,
                         env={**os.environ, "MPSRUN_KEEP_LOGS": "0"})
    own = f"exited with code {out.returncode} first".encode() in out.stderr  # the rank's own code, said so
    assert out.returncode in (0, 1, 2, 126, 127) or own, out.stderr
    ours = [line for line in out.stderr.splitlines() if not line.startswith(b"[rank ")]
    assert not any(b"Traceback" in line for line in ours), out.stderr
    if "--keep-logs" in words:  # it keeps the session on purpose: once its processes are gone, clean it up
        wait_processes_gone(fake_gpu)
        subprocess.run([*MPSRUN, "cleanup"], capture_output=True, timeout=60)
    settle(fake_gpu)


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
