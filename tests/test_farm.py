"""Farms (``mpsrun --tasks``, ``--array``) on the fake GPU: every task runs once, results lines, --resume, retries,
--max-failures, signals, a fatal GPU fault's culprit found, bad task lists refused; and nothing left behind."""

import contextlib
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from helpers import FAKE_MPS, FAKECUDA, ROOT, wait_for

from mpsrun.config.commandline import parse_args
from mpsrun.errors import ConfigError, JobTimeoutError
from mpsrun.farm.results import succeeded_tasks
from mpsrun.farm.tasks import Task, array_tasks, read_task_lines, task_lines
from mpsrun.runtime.deadline import Deadline
from mpsrun.session.record import SessionRecord

PY = sys.executable
TESTS = ROOT / "tests"


def mpsrun(*args, stdin=None, timeout=120):
    return subprocess.run([PY, "-m", "mpsrun", *args], capture_output=True, text=True, input=stdin, timeout=timeout)


def results(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_task_file_is_split_as_a_shell_splits_it_and_numbered_from_0():
    """Quotes, backslashes and comments as a shell reads them; blank and comment lines are no tasks; the tasks are
    numbered in order from 0."""
    lines = ["echo 'a b' c\\ d  # a comment\n", "\n", "# only a comment\n", '  printf "%s\\n" x\n']
    assert task_lines(lines) == [Task(0, ("echo", "a b", "c d")), Task(1, ("printf", "%s\\n", "x"))]


def test_a_task_line_a_shell_could_not_split_is_refused_naming_it():
    """An unclosed quote is a ConfigError (exit 2) naming the file's line."""
    with pytest.raises(ConfigError, match=r"tasks\.txt line 2: no closing quotation"):
        task_lines(["true\n", "echo 'oops\n"], "--tasks tasks.txt")


def test_an_array_replaces_braces_by_each_index():
    """``--array 3-7:2`` runs the command for 3, 5 and 7, ``{}`` replaced in every word; the index is the task's
    number."""
    config = parse_args(["--array", "3-7:2", "sim", "--seed", "{}", "--out=run{}.h5"], {})
    from mpsrun.config.values import parse_index_range

    assert array_tasks(config.command, parse_index_range(config.array)) == [
        Task(i, ("sim", "--seed", str(i), f"--out=run{i}.h5")) for i in (3, 5, 7)]


@pytest.mark.parametrize(("args", "said"), [
    (["--tasks", "f", "--array", "0-3", "true"], "not both"),
    (["--tasks", "f", "true"], "no command after the options"),
    (["--array", "0-3"], "give it after the options"),
    (["--array", "5-3", "true"], "no index"),
    (["--array", "1-3:0", "true"], "no index"),
    (["--array", "x", "true"], "A-B or A-B:STEP"),
    (["--results", "r.jsonl", "true"], "an option of a farm"),
    (["--tasks", "f", "--resume"], "give --results"),
    (["--tasks", "f", "--per-node"], "not with --per-node"),
    (["--tasks", "f", "--launcher", "mpiexec"], "not with --launcher mpiexec"),
    (["--tasks", "f", "--retries", "-1"], "--retries"),
    (["--array", "0-3", "--report", "r.json", "true"], "a farm records each task in --results"),  # (it was ignored)
])
def test_farm_options_that_cannot_go_together_are_refused(tmp_path, monkeypatch, args, said):
    """Each wrong combination of a farm's options is a usage error naming what is wrong."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=said):
        parse_args(args, {})


def test_every_task_runs_once_on_its_slot_and_its_result_is_a_line(fake_gpu, tmp_path):
    """12 tasks on 3 slots: each runs exactly once, as an MPS client of the job's daemon, with MPSRUN_TASK_ID and
    MPSRUN_TASK_COUNT; the results file has one line per task with its slot, GPU, exit code, times and proof."""
    reports = tmp_path / "reports"
    reports.mkdir()
    out = tmp_path / "results.jsonl"
    run = mpsrun("-np", "3", "--results", str(out), "--array", "0-11", PY, str(FAKECUDA), "--hold", "0.2",
                 "--report", str(reports / "{}.json"))
    assert run.returncode == 0, run.stderr
    assert "12 task(s): 12 succeeded, 0 failed, 0 not run" in run.stderr
    seen = {int(p.stem): json.loads(p.read_text()) for p in reports.glob("*.json")}
    assert sorted(seen) == list(range(12))
    assert all(report["mps"] and report["env"]["MPSRUN_TASK_ID"] == str(task) and
               report["env"]["MPSRUN_TASK_COUNT"] == "12" for task, report in seen.items())
    lines = results(out)
    assert sorted(line["id"] for line in lines) == list(range(12))
    assert {line["slot"] for line in lines} <= {0, 1, 2} and len({line["slot"] for line in lines}) > 1
    fields = ("exit_code", "cause", "tries", "gpu", "mps")
    assert [{name: line[name] for name in fields} for line in lines] == [dict(zip(fields, (0, "ok", 1, 0, True)))] * 12
    assert min(line["wall"] for line in lines) >= 0.2
    assert not fake_gpu.session_dirs()


def test_a_task_file_from_standard_input_runs_each_line(fake_gpu, tmp_path):
    """``--tasks -`` reads the task list from standard input; each line's words reach the program as a shell would
    pass them, without a shell (no expansion of $HOME)."""
    lines = "".join(f"{shlex.quote(PY)} -c 'import sys; print(sys.argv[1:])' {i} '$HOME x'\n" for i in range(4))
    run = mpsrun("-np", "2", "--tasks", "-", stdin=lines)
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.splitlines()) == [f"['{i}', '$HOME x']" for i in range(4)]


def test_a_failed_task_is_recorded_and_the_others_go_on(fake_gpu, tmp_path):
    """Tasks 1 and 3 fail: the others still run, the farm exits with the first failure's code (task 1's 5), and the
    summary counts and names it."""
    out = tmp_path / "r.jsonl"
    script = "import os, sys; t = int(os.environ['MPSRUN_TASK_ID']); sys.exit({1: 5, 3: 6}.get(t, 0))"
    run = mpsrun("-np", "1", "--results", str(out), "--array", "0-4", PY, "-c", script)
    assert run.returncode == 5, run.stderr
    assert "5 task(s): 3 succeeded, 2 failed, 0 not run; the first to fail: task 1 (failed, exit code 5)" in run.stderr
    assert {line["id"]: line["exit_code"] for line in results(out)} == {0: 0, 1: 5, 2: 0, 3: 6, 4: 0}


def test_retries_run_a_failed_task_again_and_count_its_tries(fake_gpu, tmp_path):
    """--retries 2: a task that fails twice then succeeds is recorded once, succeeded, with 3 tries; one that always
    fails is recorded failed after 3 tries."""
    out = tmp_path / "r.jsonl"
    script = ("import os, sys, pathlib; t = os.environ['MPSRUN_TASK_ID']; p = pathlib.Path(sys.argv[1], t); "
              "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
              "sys.exit(0 if t == '0' and n == 2 else 1)")
    run = mpsrun("--results", str(out), "--retries", "2", "--array", "0-1", PY, "-c", script, str(tmp_path))
    assert run.returncode == 1, run.stderr
    lines = {line["id"]: line for line in results(out)}
    assert (lines[0]["cause"], lines[0]["tries"]) == ("ok", 3)
    assert (lines[1]["cause"], lines[1]["tries"], lines[1]["exit_code"]) == ("failed", 3, 1)


def test_max_failures_stops_taking_tasks(fake_gpu, tmp_path):
    """--max-failures 2 on one slot of failing tasks: two run and fail, the other eight are not run."""
    run = mpsrun("--max-failures", "2", "--array", "0-9", PY, "-c", "raise SystemExit(4)")
    assert run.returncode == 4, run.stderr
    assert "10 task(s): 0 succeeded, 2 failed, 8 not run" in run.stderr


def test_a_sigint_stops_the_farm_and_resume_runs_exactly_the_rest(fake_gpu, tmp_path):
    """SIGINT in the middle of a farm: the running tasks are stopped and recorded as stopped, the farm exits 130,
    and --resume then runs exactly the tasks not recorded as succeeded: together every task succeeded once."""
    out, marks = tmp_path / "r.jsonl", tmp_path / "marks"
    marks.mkdir()
    script = ("import os, sys, time, pathlib; t = os.environ['MPSRUN_TASK_ID']; "
              "pathlib.Path(sys.argv[1], t + '.' + str(os.getpid())).touch(); time.sleep(0.3); end = time.monotonic() + 60\n"
              "while int(t) >= 6 and not pathlib.Path(sys.argv[1]).with_name('go').exists() and time.monotonic() < end:\n"
              "    time.sleep(0.02)")  # (tasks 6 and on run until the SIGINT)
    args = ["-np", "2", "--results", str(out), "--array", "0-19", PY, "-c", script, str(marks)]
    farm = subprocess.Popen([PY, "-m", "mpsrun", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    farm.send_signal(signal.SIGINT)
    _, err = farm.communicate(timeout=60)
    assert farm.returncode == 130, err
    first = results(out)
    done = {line["id"] for line in first if line["cause"] == "ok"}
    assert 0 < len(done) < 20 and any(line["cause"] == "stopped" for line in first), first
    (tmp_path / "go").touch()
    again = mpsrun("--resume", *args)
    assert again.returncode == 0, again.stderr
    rerun = {line["id"] for line in results(out)[len(first):]}
    assert rerun == set(range(20)) - done
    assert f"{20 - len(done)} task(s)" in again.stderr
    assert not fake_gpu.session_dirs()


def test_a_farm_killed_outright_leaves_no_task_running(fake_gpu, tmp_path):
    """mpsrun SIGKILLed while its slots run tasks: the session's reaper ends the running tasks (recorded in the
    session's record as they start) and removes the session, as it does a job's ranks."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = "import os, sys, time, pathlib; pathlib.Path(sys.argv[1], str(os.getpid())).touch(); time.sleep(120)"
    farm = subprocess.Popen([PY, "-m", "mpsrun", "-np", "2", "--array", "0-3", PY, "-c", script, str(marks)],
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    running = {int(mark.name) for mark in marks.iterdir()}
    wait_for(lambda: running <= {group.pid for root in fake_gpu.session_dirs()
                                 for group in SessionRecord.read(root / "session.json").ranks},
             what="the running tasks were not recorded", proc=farm)  # (as the loop turns after their start)
    farm.kill()
    farm.wait()
    tasks = [psutil.Process(int(mark.name)) for mark in marks.iterdir()]
    gone, alive = psutil.wait_procs(tasks, timeout=30)
    assert not alive and len(gone) == 2
    deadline = time.monotonic() + 30
    while fake_gpu.session_dirs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fake_gpu.session_dirs()


def faulting_task(marks, again=None):
    """A farm's task (the same for each index) as tests/executor_calls.kernels_until_fault runs it: task 3 makes the
    fault once the three others hold a context; the others run kernels until it tears them down (run again after
    it, they end at once, or exit with ``again``)."""
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); import executor_calls as c; "
              "c.kernels_until_fault(sys.argv[2], sys.argv[3], os.environ['MPSRUN_TASK_ID'] == '3', 3, "
              f"{again!r} if os.environ['MPSRUN_TASK_ID'] == '1' else None)")
    return [PY, "-c", script, str(TESTS), str(FAKE_MPS), str(marks)]


def test_a_fatal_fault_requeues_its_victims_and_names_its_culprit(fake_gpu, tmp_path):
    """Task 3 faults while tasks 0-2 run kernels beside it on one GPU: the server tears all four down. The victims
    are run again alone and succeed, uncounted as failures; task 3 faults alone and is recorded as the fault's; the
    farm exits with its code."""
    marks, out = tmp_path / "marks", tmp_path / "r.jsonl"
    marks.mkdir()
    run = mpsrun("-np", "4", "--results", str(out), "--array", "0-3", *faulting_task(marks), timeout=120)
    lines = {line["id"]: line for line in results(out)}
    assert sorted(lines) == [0, 1, 2, 3], run.stderr
    assert all(lines[i]["cause"] == "ok" and lines[i]["tries"] == 1 for i in (0, 1, 2)), lines
    assert lines[3]["cause"] == "fault" and lines[3]["exit_code"] != 0
    assert run.returncode == lines[3]["exit_code"], run.stderr
    assert "task 3 caused a fatal GPU fault (it ran alone on its MPS server)" in run.stderr
    assert "3 succeeded, 1 failed, 0 not run" in run.stderr


def test_a_suspect_that_fails_alone_without_a_fault_is_a_plain_failure(fake_gpu, tmp_path):
    """Task 1 is torn down by task 3's fault, then fails alone without one (exit 7): it is recorded as failed, not as
    the fault's; task 3 faults alone and is the fault's; the farm exits with the first failure's code."""
    marks, out = tmp_path / "marks", tmp_path / "r.jsonl"
    marks.mkdir()
    run = mpsrun("-np", "4", "--results", str(out), "--array", "0-3", *faulting_task(marks, again=7), timeout=120)
    order = results(out)
    lines_by_id = {line["id"]: line for line in order}
    assert (lines_by_id[1]["cause"], lines_by_id[1]["exit_code"]) == ("failed", 7), order
    assert lines_by_id[3]["cause"] == "fault" and lines_by_id[0]["cause"] == lines_by_id[2]["cause"] == "ok"
    first = next(line for line in order if line["cause"] != "ok")
    assert run.returncode == first["exit_code"], run.stderr
    assert "2 succeeded, 2 failed, 0 not run" in run.stderr


def test_output_filename_gives_each_task_its_own_files(fake_gpu, tmp_path):
    """--output-filename DIR: task N's stdout and stderr are DIR/task.N/stdout and stderr."""
    run = mpsrun("-np", "2", "--output-filename", str(tmp_path / "out"), "--array", "0-2", PY, "-c",
                 "import os, sys; print('out', os.environ['MPSRUN_TASK_ID']); print('err', file=sys.stderr)")
    assert run.returncode == 0, run.stderr
    for task in range(3):
        assert (tmp_path / "out" / f"task.{task}" / "stdout").read_text() == f"out {task}\n"
        assert (tmp_path / "out" / f"task.{task}" / "stderr").read_text() == "err\n"


def test_a_bad_task_file_is_one_line_and_exit_2(fake_gpu, tmp_path):
    """A task line a shell could not split: one line naming the file's line, exit 2, nothing started or left."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("true\necho 'unclosed\n")
    run = mpsrun("--tasks", str(tasks))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert f"{tasks} line 2: no closing quotation" in run.stderr
    assert not fake_gpu.session_dirs()


def test_a_task_that_cannot_be_found_is_recorded_127(fake_gpu, tmp_path):
    """A task's program that does not exist fails that task with 127 (cause not-found); the others run."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("true\nno-such-program-here x\ntrue\n")
    out = tmp_path / "r.jsonl"
    run = mpsrun("--tasks", str(tasks), "--results", str(out))
    assert run.returncode == 127, run.stderr
    assert "task 1: no-such-program-here: command not found" in run.stderr
    assert [(line["id"], line["cause"]) for line in results(out)] == [(0, "ok"), (1, "not-found"), (2, "ok")]


def test_a_farm_with_no_tasks_runs_nothing_and_succeeds(fake_gpu, tmp_path):
    """An empty task list (only comments) runs nothing and exits 0."""
    run = mpsrun("--tasks", "-", stdin="# nothing yet\n")
    assert run.returncode == 0, run.stderr
    assert not fake_gpu.session_dirs() and os.listdir(fake_gpu.tmpdir) in ([], [f"mpsrun-{os.getuid()}"])


def test_a_farm_dry_run_shows_its_slots_and_first_tasks_and_starts_nothing(fake_gpu, tmp_path):
    """--dry-run of a farm: each slot's GPU and limits, the variables its tasks get (no RANK: a task is no rank), the
    first ten tasks and how many more; nothing is started."""
    run = mpsrun("--dry-run", "-np", "2", "--thread-percentage", "auto", "--array", "0-11", "echo", "{}")
    assert run.returncode == 0, run.stderr
    assert "a farm of 2 slot(s)" in run.stdout and "slot 1: GPU 0, 50% of SMs" in run.stdout
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in run.stdout and "RANK=" not in run.stdout
    assert "task 9: echo 9\n... and 2 more\n" in run.stdout and "task 10" not in run.stdout
    assert not fake_gpu.session_dirs()


def start_node_farm(node_dir, node, nodes, *args, job="91"):
    """This node's mpsrun of a farm that ``nodes`` nodes share, as ``srun --ntasks-per-node=1`` starts it (each
    simulated node with its own MPSRUN_TMPDIR and name)."""
    env = {**os.environ, "MPSRUN_TMPDIR": str(node_dir), "MPSRUN_NODE_ID": node, "SLURM_JOB_ID": job,
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_PROCID": str("AB".index(node)),
           "SLURM_NTASKS": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})", "SLURM_NODEID": str("AB".index(node))}
    return subprocess.Popen([PY, "-m", "mpsrun", *args], env=env, stderr=subprocess.PIPE, text=True)


def test_two_nodes_farms_take_each_task_of_one_list_exactly_once(fake_gpu, tmp_path):
    """Two nodes' farms (as srun starts them: one mpsrun per node) share one task list through --results: every task
    runs exactly once, on one node or the other, both nodes take tasks (the first four wait for each other, so both
    nodes' slots must hold one), and the shared counter and its lock are gone at the end."""
    out, marks = tmp_path / "r.jsonl", tmp_path / "marks"
    marks.mkdir()
    script = ("import os, sys, time, pathlib; d = pathlib.Path(sys.argv[1]); t = int(os.environ['MPSRUN_TASK_ID']); "
              "(d / str(t)).touch(); end = time.monotonic() + 60\n"
              "while t < 4 and len(list(d.iterdir())) < 4 and time.monotonic() < end: time.sleep(0.02)")
    nodes = []
    for node in "AB":
        (fake_gpu.tmpdir / node).mkdir(mode=0o700)
        nodes.append(start_node_farm(fake_gpu.tmpdir / node, node, 2, "-np", "2", "--results", str(out), "--array", "0-19",
                                     PY, "-c", script, str(marks)))
    errors = [farm.communicate(timeout=120)[1] for farm in nodes]
    assert [farm.returncode for farm in nodes] == [0, 0], errors
    lines = results(out)
    assert sorted(line["id"] for line in lines) == list(range(20)), lines
    ran = [int(re.search(r"this node's part of 20 task\(s\): (\d+) succeeded, 0 failed", err)[1]) for err in errors]
    assert sum(ran) == 20 and min(ran) >= 2, errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marks", "r.jsonl"]


def test_a_farm_one_of_several_needs_a_results_file(fake_gpu, tmp_path):
    """A farm started as one of several nodes' without --results has no list to share: exit 2 in one line."""
    farm = start_node_farm(fake_gpu.tmpdir, "A", 2, "--array", "0-3", "true")
    _, err = farm.communicate(timeout=60)
    assert farm.returncode == 2 and "share the task list through --results" in err, err


def test_a_batch_scripts_own_slurm_variables_make_no_shared_farm(fake_gpu, tmp_path):
    """In a Slurm batch script (SLURM_NTASKS, SLURM_PROCID, no step) a farm is the script's own: it runs every task
    without --results, alone."""
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    out = subprocess.run([PY, "-m", "mpsrun", "--array", "0-3", "true"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "4 task(s): 4 succeeded" in out.stderr, out.stderr


def test_a_farm_on_a_terminal_draws_its_progress_and_keeps_task_lines_whole(fake_gpu):
    """On a terminal (a pseudo-terminal of no size, as `script` makes) the farm draws one progress line (tqdm's:
    tasks done, rate) that steps aside for every task line: each task's line arrives whole, on a line of its own."""
    import pty

    leader, follower = pty.openpty()
    farm = subprocess.Popen([PY, "-m", "mpsrun", "-np", "2", "--array", "0-5", PY, "-c",
                             "import os, time; time.sleep(0.2); print('done', os.environ['MPSRUN_TASK_ID'])"],
                            stdout=follower, stderr=follower)
    os.close(follower)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the farm has ended
        while chunk := os.read(leader, 65536):
            seen += chunk
    os.close(leader)
    assert farm.wait(timeout=60) == 0, seen
    assert b"task/s" in seen and b"mpsrun:" in seen, seen
    lines = seen.replace(b"\r\n", b"\n").split(b"\n")
    assert sorted(line.rsplit(b"\r", 1)[-1] for line in lines if line[-1:].isdigit()) == [
        f"done {i}".encode() for i in range(6)], seen


def test_the_plain_progress_line_says_done_failed_running_left_and_rate():
    """Where the output is no terminal the progress is a plain line (said now and then): what is done and failed,
    running and left, the rate and the time left; -q says nothing and draws nothing."""
    import io

    from mpsrun.farm.progress import Progress

    progress = Progress(10, io.StringIO())
    assert progress.plain and progress.bar is None
    progress.update(4, 1, 2)
    assert re.fullmatch(r"4 of 10 task\(s\) done \(1 failed\), 2 running, 6 left; [0-9.]+ tasks/s, about \d+ s left",
                        progress.line()), progress.line()
    assert not Progress(10, io.StringIO(), quiet=True).plain


def test_top_shows_each_slot_with_the_task_it_runs(fake_gpu, tmp_path):
    """`mpsrun top --json` while a farm's two slots run tasks 0 and 1: a row per slot (its number in the rank's
    place) with its task, on GPU 0, an MPS client."""
    release = tmp_path / "release"
    farm = subprocess.Popen([PY, "-m", "mpsrun", "-np", "2", "--array", "0-1", PY, str(FAKECUDA), "--hold", "0.1",
                             "--until-file", str(release)], stderr=subprocess.PIPE, text=True)
    try:
        deadline, rows = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            look = mpsrun("top", "--json")
            rows = [row for row in json.loads(look.stdout)["ranks"] if row["task"] is not None] if look.stdout else []
            if len(rows) == 2 and all(row["mps"] for row in rows):
                break
            time.sleep(0.2)
    finally:
        release.touch()
        _, err = farm.communicate(timeout=60)
    assert farm.returncode == 0, err
    assert sorted((row["rank"], row["task"]) for row in rows) in ([(0, 0), (1, 1)], [(0, 1), (1, 0)]), rows
    assert all(row["gpu"] == 0 and row["mps"] is True for row in rows), rows


def test_slots_beyond_the_tasks_are_not_started(fake_gpu):
    """-np larger than the task list: only as many slots as tasks run (a hundred thousand slots for two tasks took
    minutes of one core before, each task's end walking every slot), placed as -np asked: a per-slot list of
    thread percentages still gives the first slots theirs."""
    run = mpsrun("-np", "100000", "--array", "1-2", "true", timeout=60)
    assert run.returncode == 0 and "2 task(s): 2 succeeded" in run.stderr, run.stderr
    run = mpsrun("-np", "3", "--thread-percentage", "10,20,30", "--array", "1-2", PY, "-c",
                 "import os; print(os.environ['MPSRUN_SLOT'], os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'])")
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.split("\n")[:-1]) == ["0 10", "1 20"], run.stdout


# -- what a hostile pass found (each failed before its fix) -----------------------------------------------------------


@pytest.mark.parametrize(("line", "said"), [("echo a\0b", "a NUL character"), ("echo " + "x" * 300_000, "longer than")])
def test_a_task_line_no_command_can_be_is_refused_before_anything_starts(fake_gpu, tmp_path, line, said):
    """A NUL in a task line (a traceback, and the running tasks left behind) or a line of 300 KB (splitting it took
    minutes) is one line naming the line, exit 2, and nothing starts."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text(f"true\n{line}\n")
    run = mpsrun("--tasks", str(tasks), timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and f"line 2: {said}" in run.stderr, run.stderr
    assert not fake_gpu.session_dirs()


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_task_file_without_a_newline_is_refused_without_reading_it_whole(fake_gpu, source):
    """--tasks /dev/zero (or standard input from it) is refused at its first line, exit 2: the whole "line" was read
    before it was measured (a MemoryError traceback under a memory limit, all the memory without one)."""
    if source == "file":
        run = mpsrun("--tasks", "/dev/zero", timeout=60)
    else:
        with open("/dev/zero", "rb") as zero:
            run = subprocess.run([PY, "-m", "mpsrun", "--tasks", "-"], stdin=zero, capture_output=True, text=True,
                                 timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "line 1: longer than 64 KiB" in run.stderr, \
        run.stderr


@pytest.mark.parametrize("source", ["fifo", "stdin"])
def test_a_task_list_no_one_writes_ends_the_farm_at_its_timeout(fake_gpu, tmp_path, source):
    """--tasks FIFO with no writer, or --tasks - from a pipe that stays open, under --timeout 3: exit 124 at the
    timeout, saying what it waited for, with nothing left (command-line.md: start-up included). The farm waited for
    the list for ever: a FIFO's open until a writer came, the pipe until its writer closed it."""
    argv = [PY, "-m", "mpsrun", "-np", "2", "--timeout", "3", "--tasks"]
    if source == "fifo":
        fifo = tmp_path / "tasks"
        os.mkfifo(fifo)
        run = subprocess.run([*argv, str(fifo)], capture_output=True, text=True, timeout=40)
        what = f"--tasks {fifo}"
    else:
        reader, writer = os.pipe()
        try:
            run = subprocess.run([*argv, "-"], stdin=reader, capture_output=True, text=True, timeout=40)
        finally:
            os.close(reader)
            os.close(writer)
        what = "--tasks - (standard input)"
    assert run.returncode == 124, run.stderr
    assert run.stderr == f"mpsrun: error: timed out after 3 s while reading the task list ({what})\n"
    assert not fake_gpu.session_dirs()


def test_a_plain_task_line_is_split_as_shlex_splits_it():
    """Lines with no quote, backslash or comment take a quicker way than shlex's: the same words (tabs, carriage
    returns and other blanks between them; other characters, as shlex keeps them, within)."""
    lines = ["a  b\tc\r\n", " x\x0by  z\n", "f=1 g\u00a0h $HOME * ; && |\n", "\t \n"]
    assert task_lines(lines) == [Task(number, tuple(shlex.split(line, comments=True)))
                                 for number, line in enumerate(line for line in lines if line.strip(" \t\r\n"))]


def test_results_that_cannot_be_written_stop_the_farm_and_leave_no_task(fake_gpu, tmp_path):
    """--results on a full disk (/dev/full): one line naming --results and the task, exit 3, and the task still
    running is ended (it was left running when the error left the farm's loop)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = "import os, sys, time, pathlib; pathlib.Path(sys.argv[1], str(os.getpid())).touch(); time.sleep(int(sys.argv[2]))"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text(f"{PY} -c '{script}' {marks} 0\n{PY} -c '{script}' {marks} 95\n")
    run = mpsrun("-np", "2", "--tasks", str(tasks), "--results", "/dev/full", timeout=60)
    assert run.returncode == 3 and "--results /dev/full: cannot write task 0's result" in run.stderr, run.stderr
    pids = [int(mark.name) for mark in marks.iterdir()]
    assert pids and not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_resume_after_a_line_cut_short_writes_whole_lines(fake_gpu, tmp_path):
    """A results file whose last line was cut short (a farm killed as it wrote): --resume ends that line first, so
    the task it reruns is recorded whole, and a second --resume runs nothing (before, the new line was glued to the
    cut one and lost, and every --resume ran the task again)."""
    out = tmp_path / "c.jsonl"
    assert mpsrun("-q", "--array", "0-3", "--results", str(out), "true").returncode == 0
    out.write_bytes(out.read_bytes()[:-40])
    assert mpsrun("--resume", "--array", "0-3", "--results", str(out), "true").returncode == 0
    again = mpsrun("--resume", "--array", "0-3", "--results", str(out), "true")
    assert again.returncode == 0 and "0 task(s) (4 succeeded before)" in again.stderr, again.stderr


@pytest.mark.parametrize("planted", ["device", "deep"])
def test_resume_reads_back_only_a_regular_file_and_skips_what_is_no_line_of_ours(fake_gpu, tmp_path, planted):
    """--resume with --results /dev/zero (it read without end, gigabytes) is refused in one line, exit 2; a line
    nested a hundred thousand deep (RecursionError, a traceback) is skipped like any line that is not a result."""
    if planted == "device":
        run = mpsrun("--resume", "--array", "1-2", "--results", "/dev/zero", "true", timeout=60)
        assert run.returncode == 2 and "not a regular file" in run.stderr, run.stderr
        return
    out = tmp_path / "d.jsonl"
    out.write_text("[" * 100_000 + "\n")
    run = mpsrun("--resume", "--array", "0-1", "--results", str(out), "true", timeout=60)
    assert run.returncode == 0 and "2 task(s): 2 succeeded" in run.stderr, run.stderr


def test_a_farms_timeout_is_said_and_exits_124_even_as_the_daemons_start(fake_gpu):
    """--timeout that passes as the farm runs says so (it said only the tally), exit 124; one that passes while the
    daemons start (0.01 s) is exit 124 too (sometimes 3 before, as a daemon that did not answer)."""
    run = mpsrun("--timeout", "1", "--array", "0-1", "sleep", "5", timeout=60)
    assert run.returncode == 124 and "timed out after 1 s" in run.stderr, run.stderr
    for _ in range(3):
        run = mpsrun("-np", "2", "--timeout", "0.01", "--array", "0-3", PY, str(FAKECUDA), "--hold", "3", timeout=60)
        assert run.returncode == 124, run.stderr


def test_fifos_without_a_reader_never_hold_a_farm(fake_gpu, tmp_path):
    """A FIFO with no reader as --results is refused in one line (the farm waited for a reader); one planted as a
    task's --output-filename file fails that task alone (the farm hung, deaf to SIGTERM)."""
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    run = mpsrun("--array", "0-1", "--results", str(fifo), "true", timeout=60)
    assert run.returncode == 2 and "a FIFO that no one reads" in run.stderr, run.stderr
    (tmp_path / "od" / "task.0").mkdir(parents=True)
    os.mkfifo(tmp_path / "od" / "task.0" / "stdout")
    run = mpsrun("--array", "0-1", "--output-filename", str(tmp_path / "od"), "echo", "{}", timeout=60)
    assert run.returncode == 3 and "1 succeeded, 1 failed" in run.stderr, run.stderr


def test_a_results_fifo_whose_reader_stops_reading_stops_the_farm_in_one_line(fake_gpu, tmp_path):
    """--results into a FIFO whose reader holds it open but reads nothing: once the pipe is full (64 KiB of results),
    the farm stops in one line, exit 3, and leaves nothing running (it blocked in the write for good, deaf to
    --timeout, SIGTERM and SIGINT: only SIGKILL ended it)."""
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read
    try:
        # (each result's line holds its 4 KiB command: a few tasks fill the pipe)
        run = mpsrun("-q", "-np", "2", "--array", "0-999", "--timeout", "100", "--results", str(fifo), "true",
                     "x" * 4096, timeout=90)
    finally:
        os.close(reader)
    said = [line for line in run.stderr.splitlines() if line.startswith("mpsrun")]
    assert run.returncode == 3 and "whose reader took nothing" in run.stderr, run.stderr
    assert len(said) <= 2, said  # the write's failure, and the tally


def test_a_launcher_that_names_no_job_gets_no_shared_farm(fake_gpu, tmp_path):
    """Two farms under an MPI launcher that names no job (MPICH's Hydra: PMI_RANK, PMI_SIZE): each node's key
    differed, so a later node started the list anew and tasks ran twice. Now it is refused, naming the variable to
    set, and nothing is written beside the results file."""
    env = {**os.environ, "PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    env = {name: value for name, value in env.items() if name != "MPSRUN_JOB_ID"}
    run = subprocess.run([PY, "-m", "mpsrun", "--array", "0-3", "--results", str(tmp_path / "r.jsonl"), "true"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "set MPSRUN_JOB_ID" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_shared_list_held_by_another_process_ends_the_farm_at_its_timeout(fake_gpu, tmp_path):
    """A farm of two nodes whose shared list's lock another process holds: --timeout 3 ends it at the timeout, exit
    124 naming the lock, with nothing of its own left. It waited 60 s for the lock, whatever the timeout."""
    lock = tmp_path / "r.jsonl.lock"
    lock.touch()
    env = {**os.environ, "PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
           "MPSRUN_JOB_ID": "j1"}
    held = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        run = subprocess.run([PY, "-m", "mpsrun", "--timeout", "3", "--array", "0-3", "--results",
                              str(tmp_path / "r.jsonl"), "true"], env=env, capture_output=True, text=True, timeout=45)
    finally:
        os.close(held)
    assert run.returncode == 124, run.stderr
    assert run.stderr == f"mpsrun: error: timed out after 3 s while another node held the farm's shared task list " \
        f"({lock})\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl.lock"]  # (the holder's)
    assert not fake_gpu.session_dirs()


def test_two_nodes_farms_that_time_out_together_leave_nothing_beside_the_results(fake_gpu, tmp_path):
    """Two nodes' farms of one list whose --timeout passes at the same moment: both exit 124, and each still counts
    itself out of the shared list as it ends (its lock held a moment by the other), so the counter and the lock go."""
    out = tmp_path / "r.jsonl"
    for node in "AB":
        (fake_gpu.tmpdir / node).mkdir(mode=0o700)
    farms = [start_node_farm(fake_gpu.tmpdir / node, node, 2, "-np", "2", "--timeout", "3", "--grace", "0.5",
                             "--array", "0-9", "--results", str(out), "sleep", "30") for node in "AB"]
    errors = [farm.communicate(timeout=60)[1] for farm in farms]
    assert [farm.returncode for farm in farms] == [124, 124], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"], errors


def test_a_task_file_or_a_results_file_still_read_at_the_timeout_is_a_timeout(tmp_path):
    """A regular task file, or the results file --resume reads back, still being read when the job's --timeout
    passes: JobTimeoutError (exit 124), naming the file. Both were read to their end first (a 3 GB task file of
    comments past any timeout, then exit 0 for no task; a 30 GB sparse results file for minutes)."""
    tasks, done = tmp_path / "tasks", tmp_path / "r.jsonl"
    tasks.write_text("true\n" * 3)
    done.write_text(json.dumps({"id": 0, "cause": "ok", "command": ["true"]}) + "\n")
    assert len(read_task_lines(str(tasks), 0, Deadline(None))) == 3
    assert succeeded_tasks(str(done), Deadline(None)) == {0: ("true",)}
    with pytest.raises(JobTimeoutError, match=f"timed out after 0 s while reading the task list \\(--tasks {tasks}"):
        read_task_lines(str(tasks), 0, Deadline(0))
    with pytest.raises(JobTimeoutError, match=f"timed out after 0 s while --resume read back --results {done}"):
        succeeded_tasks(str(done), Deadline(0))


def test_a_node_that_cannot_start_its_farm_is_counted_out(fake_gpu, tmp_path):
    """One node of two whose task file is missing (exit 2) still counts itself out of the shared list, so the other
    node's end removes the counter and its lock (they were left beside the results)."""
    out = tmp_path / "r.jsonl"
    for node in "AB":
        (fake_gpu.tmpdir / node).mkdir(mode=0o700)
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("true\n" * 4)
    failed = start_node_farm(fake_gpu.tmpdir / "B", "B", 2, "--tasks", str(tmp_path / "missing"), "--results",
                             str(out))
    assert failed.wait(timeout=60) == 2
    farm = start_node_farm(fake_gpu.tmpdir / "A", "A", 2, "--tasks", str(tasks), "--results", str(out))
    assert farm.wait(timeout=60) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "tasks.txt"]


def test_a_counter_changed_under_the_farm_stops_it_in_one_line(fake_gpu, tmp_path):
    """A shared list's counter another program changed (a negative next task ran tasks twice; a non-number count of
    ends was a traceback) stops the node's farm in one line, exit 3, with nothing left running."""
    out = tmp_path / "r.jsonl"
    (fake_gpu.tmpdir / "A").mkdir(mode=0o700)
    marks = tmp_path / "marks"
    marks.mkdir()
    script = ("import sys, time, pathlib; pathlib.Path(sys.argv[1], 'ran').touch(); end = time.monotonic() + 60\n"
              "while not pathlib.Path(sys.argv[1], 'go').exists() and time.monotonic() < end: time.sleep(0.02)")
    farm = start_node_farm(fake_gpu.tmpdir / "A", "A", 2, "--array", "0-3", "--results", str(out), PY, "-c", script,
                           str(marks))
    deadline = time.monotonic() + 60
    while not (marks / "ran").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    queue = tmp_path / "r.jsonl.queue"
    queue.write_text(json.dumps({**json.loads(queue.read_text()), "next": -5, "ended": "x"}))
    (marks / "go").touch()  # (the tasks ran on until the counter was changed)
    _, err = farm.communicate(timeout=60)
    assert farm.returncode == 3 and "was removed or changed by another program" in err, err
    assert "Traceback" not in err


def test_an_argument_list_too_long_is_126_and_an_id_of_true_is_no_tasks():
    """A task whose words exceed what exec takes (E2BIG) fails 126, not-executable, as a shell says it (it was
    recorded as a task that ran and exited 3); an id of true in a results file is no task's."""
    import errno

    from mpsrun.farm.results import succeeded_tasks
    from mpsrun.rank.command import exec_failure_code

    assert exec_failure_code(OSError(errno.E2BIG, "Argument list too long")) == 126
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as out:
        out.write(json.dumps({"id": True, "cause": "ok", "command": ["true"]}) + "\n")
        out.flush()
        assert succeeded_tasks(out.name, Deadline(None)) == {}


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_a_results_line_names_the_gpu_by_its_index(fake_gpu, tmp_path):
    """With --gpus 1, each results line's GPU is 1, the GPU's index as nvidia-smi and mpsrun's -v name it (it was 0,
    the GPU's place among the job's)."""
    out = tmp_path / "r.jsonl"
    run = mpsrun("--gpus", "1", "--array", "0-1", "--results", str(out), "true")
    assert run.returncode == 0, run.stderr
    assert [line["gpu"] for line in results(out)] == [1, 1]


def test_a_farms_own_variables_do_not_reach_its_tasks(fake_gpu, tmp_path):
    """A farm set by variables (MPSRUN_ARRAY, MPSRUN_RESULTS): its tasks get neither, so an mpsrun a task runs is a
    job of its own (it became a farm too, and appended its own tasks' lines to the same results: 14 lines for 3
    tasks); the task's own variables are there."""
    out = tmp_path / "r.jsonl"
    show = "import os; print(' '.join(sorted(n for n in os.environ if n.startswith('MPSRUN_'))))"
    env = {**os.environ, "MPSRUN_ARRAY": "0-1", "MPSRUN_RESULTS": str(out), "MPSRUN_RETRIES": "0"}
    run = subprocess.run([PY, "-m", "mpsrun", "-q", "-np", "2", PY, "-c", show], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and len(results(out)) == 2, run.stderr
    for line in run.stdout.splitlines():
        names = set(line.split())
        assert "MPSRUN_TASK_ID" in names and not names & {"MPSRUN_ARRAY", "MPSRUN_RESULTS", "MPSRUN_RETRIES"}, line


def test_results_into_the_task_file_itself_are_refused(tmp_path):
    """--tasks F --results F (the same file, by any name): refused, exit 2 (the results were appended to the task
    list, and --resume then ran them as commands)."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("true\n")
    os.symlink(tasks, tmp_path / "also.txt")
    with pytest.raises(ConfigError, match="names the task file"):
        parse_args(["--tasks", str(tasks), "--results", str(tmp_path / "also.txt")], environ={})


def test_a_task_reads_nothing_from_the_farms_standard_input(fake_gpu):
    """Each task's standard input is /dev/null: tasks that run at once shared the farm's, and split what came."""
    run = mpsrun("-q", "-np", "2", "--array", "0-1", PY, "-c", "import sys; print(repr(sys.stdin.read()))",
                 stdin="what the farm was given\n", timeout=60)
    assert run.returncode == 0 and run.stdout == "''\n''\n", run.stdout


def test_a_second_sigterm_leaves_the_tasks_their_grace(fake_gpu, tmp_path):
    """Two SIGTERMs (GNU timeout sends one to mpsrun and one to its group): the tasks still get --grace to finish
    (the second killed them at once, as only a second Ctrl-C should); the farm exits 143."""
    marks = tmp_path / "marks"
    marks.mkdir()
    task = ("import pathlib, signal, sys, time\n"
            "def term(*_):\n"
            f"    pathlib.Path({str(marks)!r}, 'term').touch(); time.sleep(1.0)\n"
            f"    pathlib.Path({str(marks)!r}, 'cleaned').touch(); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            f"pathlib.Path({str(marks)!r}, 'started').touch(); time.sleep(60)")
    farm = subprocess.Popen([PY, "-m", "mpsrun", "-q", "--grace", "30", "--array", "0-0", PY, "-c", task],
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (marks / "started").exists(), what="the task did not start", proc=farm)
    farm.send_signal(signal.SIGTERM)
    wait_for(lambda: (marks / "term").exists(), what="the task got no SIGTERM", proc=farm)
    farm.send_signal(signal.SIGTERM)
    _, err = farm.communicate(timeout=60)
    assert farm.returncode == 143 and (marks / "cleaned").exists(), err


def test_more_slots_on_a_gpu_than_its_mps_server_takes_are_warned_of(fake_gpu):
    """-np 50 slots on one GPU: warned of once, as 50 ranks are (a farm said nothing, and its 49th client would
    fail on a real server); 48 slots are not."""
    run = mpsrun("-np", "50", "--gpus", "0", "--array", "0-49", "true", timeout=120)
    assert run.returncode == 0 and run.stderr.count("50 slots share GPU 0, but an MPS server accepts at most 48") == 1
    run = mpsrun("-np", "48", "--gpus", "0", "--array", "0-47", "true", timeout=120)
    assert run.returncode == 0 and "share GPU" not in run.stderr, run.stderr


@pytest.mark.parametrize("text", ["1-" + "9" * 5000, "\uff11-\uff13", "0-" + "9" * 26])
def test_an_array_range_of_odd_digits_is_refused_in_a_short_line(text):
    """--array with 5,000 digits (a message naming parse_index_range_text and echoing them all; as a variable,
    Python's int digits limit), other scripts' digits (full-width ones ran 1-3), or a range past 2**63 (len()
    overflows): a ConfigError of one short line."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["--array", text, "true"], environ={})
    said = str(refused.value)
    assert "parse_" not in said and len(said) < 160 and "\n" not in said, said


def test_a_count_of_many_digits_is_refused_in_a_short_line():
    """-np, --retries and --max-failures with 5,000 digits: refused in a line that shows the start of the value
    (Python's int digits limit reached argparse, which named the parsing function and echoed every digit)."""
    for option in ("-np", "--retries", "--max-failures"):
        with pytest.raises(ConfigError) as refused:
            parse_args([option, "9" * 5000, "--array", "0-1", "true"], environ={})
        said = str(refused.value)
        assert "parse_" not in said and len(said) < 160, said


def test_a_fifo_planted_as_the_shared_counter_holds_no_farm(fake_gpu, tmp_path):
    """A FIFO planted where a shared list keeps its counter (RESULTS.queue): the farm replaces it (never opens it)
    and runs every task; it waited at its start for a writer that never came."""
    out = tmp_path / "r.jsonl"
    os.mkfifo(tmp_path / "r.jsonl.queue")
    farms = []
    for node in "AB":
        (fake_gpu.tmpdir / node).mkdir(mode=0o700)
        farms.append(start_node_farm(fake_gpu.tmpdir / node, node, 2, "--array", "0-3", "--results", str(out),
                                     "true"))
    for farm in farms:
        _, err = farm.communicate(timeout=60)
        assert farm.returncode == 0, err
    assert sorted(line["id"] for line in results(out)) == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_a_farm_set_wholly_by_variables_runs_with_no_argument(fake_gpu, tmp_path):
    """MPSRUN_TASKS=FILE and a bare `mpsrun` (a batch script that sets its farm in variables): the farm runs (the
    bare command printed the help and exited 2); a bare `mpsrun` without it still prints the help."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("echo a\necho b\n")
    run = subprocess.run([PY, "-m", "mpsrun"], env={**os.environ, "MPSRUN_TASKS": str(tasks)}, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and sorted(run.stdout.split()) == ["a", "b"], run.stderr
    env = {name: value for name, value in os.environ.items() if name != "MPSRUN_TASKS"}
    run = subprocess.run([PY, "-m", "mpsrun"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "usage:" in run.stderr


def test_a_results_fifo_read_slowly_a_little_at_a_time_holds_the_farm_up_without_failing_it(fake_gpu, tmp_path):
    """A --results FIFO whose reader takes a few hundred bytes at a time, slowly, then the rest: the farm waits for it
    and succeeds (a pipe says it has room only once a whole page is free, so such a reader was taken for one that
    stopped reading: exit 3 after 2 s)."""
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen([PY, "-c", (
        "import array, fcntl, sys, termios, time\n"
        "f = open(sys.argv[1], 'rb', buffering=0)\n"
        "held = array.array('i', [0])\n"  # (until the pipe is half full: each result's line holds its 1 KiB command)
        "while fcntl.ioctl(f, termios.FIONREAD, held) or held[0] < 32768: time.sleep(0.05)\n"
        "n = 0\n"
        "for _ in range(8): n += f.read(200).count(b'\\n'); time.sleep(0.35)\n"
        "while chunk := f.read(65536): n += chunk.count(b'\\n')\n"
        "print(n)"), str(fifo)], stdout=subprocess.PIPE, text=True)
    run = mpsrun("-q", "-np", "2", "--array", "0-149", "--results", str(fifo), "true", "x" * 1024, timeout=90)
    out, _ = reader.communicate(timeout=60)
    assert run.returncode == 0 and int(out) == 150, run.stderr


def test_too_few_open_files_for_the_slots_is_refused_before_any_task(fake_gpu, tmp_path):
    """A hard limit of 40 open files for 30 slots: refused in one line before anything starts, exit 3, and no task
    recorded (83 of 100 tasks were recorded as failed with "/dev/null: Too many open files", mpsrun's own failure);
    a soft limit as low is raised, and the farm runs."""
    import resource

    out = tmp_path / "r.jsonl"
    argv = [PY, "-m", "mpsrun", "-q", "-np", "30", "--array", "0-99", "--results", str(out), "true"]
    hard = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40)))
    assert hard.returncode == 3 and "30 slot(s) need about" in hard.stderr and results(out) == [], hard.stderr
    soft = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, 4096)))
    assert soft.returncode == 0 and len(results(out)) == 100, soft.stderr


def test_results_into_the_task_list_read_from_standard_input_are_refused(tmp_path):
    """--tasks - with standard input from the results file: refused, exit 2 (the results were appended to the task
    file, which the next run ran as tasks)."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("true\n")
    with open(tasks) as stdin:
        run = subprocess.run([PY, "-m", "mpsrun", "--tasks", "-", "--results", str(tasks)], stdin=stdin,
                             capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "names the task file" in run.stderr and tasks.read_text() == "true\n", run.stderr


def test_the_command_lines_tasks_or_array_wins_over_the_others_variable(fake_gpu, tmp_path):
    """MPSRUN_TASKS exported and --array on the command line (or MPSRUN_ARRAY and --tasks): the command line wins,
    as for every option (it was refused: "give --tasks or --array, not both"); MPSRUN_ARRAY with a bare mpsrun is one
    line, not the help."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("echo from-file\n")
    env = {**os.environ, "MPSRUN_TASKS": str(tasks)}
    run = subprocess.run([PY, "-m", "mpsrun", "-q", "--array", "0-0", "echo", "from-array"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "from-array\n", run.stderr
    env = {**os.environ, "MPSRUN_ARRAY": "0-1"}
    run = subprocess.run([PY, "-m", "mpsrun", "-q", "--tasks", str(tasks)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout == "from-file\n", run.stderr
    run = subprocess.run([PY, "-m", "mpsrun"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--array runs a command" in run.stderr, run.stderr


@pytest.mark.parametrize("planted", ["directory", "link loop"])
def test_a_shared_lists_lock_planted_as_no_file_is_said_as_the_farms_lock(fake_gpu, tmp_path, planted):
    """A directory, or a link to itself, where several nodes' farms keep their lock (RESULTS.lock): one line naming
    the farm's lock, exit 3 (a bare "Is a directory: PATH")."""
    lock = tmp_path / "r.jsonl.lock"
    lock.mkdir() if planted == "directory" else os.symlink(lock, lock)
    (fake_gpu.tmpdir / "A").mkdir(mode=0o700)
    farm = start_node_farm(fake_gpu.tmpdir / "A", "A", 2, "--array", "0-3", "--results", str(tmp_path / "r.jsonl"),
                           "true")
    _, err = farm.communicate(timeout=60)
    assert farm.returncode == 3 and "cannot lock the farm's shared task list" in err, err
    assert err.count("\n") == 1, err
