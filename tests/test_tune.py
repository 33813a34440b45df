"""``mpsrun tune`` and ``mpsrun.tune`` on the fake GPU: the grid, the recommendation, ties, failures, the budget,
an interruption, bad settings and the JSON.

The programs tuned here print a rate that depends on the setting (``--metric``), so what tune must conclude is
known exactly; timing-based throughput is shown on the H100 (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from helpers import MPSRUN, settle, wait_for

import mpsrun
from mpsrun.errors import ConfigError
from mpsrun.tuning import TuneResult
from mpsrun.tuning.report import format_report, plot

#: Each rank prints a rate: 100 under MPS, 10 without (so MPS with the most ranks wins, 10x per rank).
MPS_WINS = ("import os; mps = bool(os.environ.get('CUDA_MPS_PIPE_DIRECTORY')); "
            "print('rate:', 100 if mps else 10, flush=True)")
#: The job's rate is 60 whatever the setting (each rank prints its share): nothing beats the baseline.
FIXED_WORK = "import os; print('rate:', 60 / int(os.environ['WORLD_SIZE']))"


def _tune(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MPSRUN, "tune", *args], capture_output=True, text=True, timeout=timeout)


def test_mps_with_the_most_ranks_is_recommended_with_its_gain(fake_gpu, tmp_path):
    """The setting of the highest throughput is recommended as the exact command to run, with its gain over the
    baseline (one rank without MPS) and the next best; the JSON says the same, and read back
    (TuneResult.from_json) it gives the same table and, with the plot extra, a figure."""
    out = _tune("--ranks", "1,2", "--repeats", "2", "--metric", r"rate: (\S+)", "--json", "--",
                sys.executable, "-c", MPS_WINS)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {(t["ranks"], t["mps"]) for t in result["trials"]} == {(n, m) for n in (1, 2) for m in ("on", "off")}
    assert all(t["exit_code"] == 0 and len(t["seconds"]) == 2 for t in result["trials"])
    assert result["best"]["ranks"] == 2 and result["best"]["mps"] == "on" and result["best"]["throughput"] == 200
    assert result["baseline"]["ranks"] == 1 and result["baseline"]["mps"] == "off" and result["beats_baseline"]
    assert result["command"].startswith("mpsrun -np 2 --mps on -- ")
    again = TuneResult.from_json(result)
    assert again.to_json() == result
    table = format_report(again, 2)
    assert "run: mpsrun -np 2 --mps on --" in table and "20.00x the baseline (-np 1 --mps off)" in table
    assert "2.00x the next best (-np 1 --mps on)" in table
    settle(fake_gpu)
    pytest.importorskip("matplotlib")
    plot(again, str(tmp_path / "tune.png"))
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_beating_the_baseline_is_said_plainly(fake_gpu):
    """When every setting gives the same throughput, each is a tie with the best, and tune says that nothing beats
    the baseline beyond the noise and recommends the baseline itself."""
    out = _tune("--ranks", "1,2", "--mps", "on,off", "--repeats", "1", "--metric", r"rate: (\S+)", "--",
                sys.executable, "-c", FIXED_WORK)
    assert out.returncode == 0, out.stderr
    assert "nothing beats the baseline (-np 1 --mps off) beyond the noise" in out.stdout, out.stdout
    assert "run: mpsrun -np 1 --mps off --" in out.stdout and out.stdout.count("tie with the best") == 3
    settle(fake_gpu)


def test_a_failing_setting_is_reported_and_the_rest_go_on(fake_gpu):
    """A setting whose job fails shows its exit code and why; the other settings are measured and one recommended."""
    program = "import os, sys; sys.exit('too many ranks') if os.environ['WORLD_SIZE'] == '2' else print('rate: 1')"
    out = _tune("--ranks", "1,2", "--mps", "off", "--repeats", "1", "--metric", r"rate: (\S+)", "--json", "--",
                sys.executable, "-c", program)
    assert out.returncode == 0, out.stderr
    trials = {t["ranks"]: t for t in json.loads(out.stdout)["trials"]}
    assert trials[2]["exit_code"] == 1 and trials[2]["throughput"] is None and "too many ranks" in trials[2]["error"]
    assert trials[1]["exit_code"] == 0 and trials[1]["throughput"] == 1
    settle(fake_gpu)


@pytest.mark.parametrize(("args", "why"), [
    (["--ranks", "0,x"], "--ranks"), (["--mps", "on,maybe"], "--mps"), (["--thread-percentage", "none,150"], "--thread"),
    (["--repeats", "0"], "--repeats"), (["--budget", "-1"], "--budget"), (["--scaling", "sideways"], "--scaling"),
    (["--metric", "("], "--metric"), (["-np", "4"], "give --ranks"), (["--mps=on,off", "--bogus"], "--bogus"),
    (["--ranks", "1,"], "--ranks"), (["-n4"], "give --ranks"), (["--np=4"], "give --ranks"),
    (["--per-node"], "--per-node"), (["--version"], "--version"), (["--repeats", "100000"], "--repeats"),
    (["--plot", "/nonexistent/x.png"], "--plot"), (["--plot", ""], "--plot"), (["--dry-run"], "--dry-run starts nothing"),
    (["--queues", "auto,0"], "--queues"), (["--queues", "33"], "1 to 32"), (["--queues", "many"], "--queues"),
    (["-x", "CUDA_DEVICE_MAX_CONNECTIONS=4"], "as --queues"),
])
def test_bad_settings_are_one_line_and_exit_2_before_anything_runs(fake_gpu, short_tmp, args, why):
    """A bad list value, an option tune sets itself, an unknown job option, --dry-run (whose trials measured nothing and
    exited 0): one line, exit 2, and no trial ran."""
    marker = short_tmp / "ran"
    out = _tune(*args, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and why in out.stderr, out.stderr
    assert not marker.exists() and not fake_gpu.session_dirs()


def test_a_command_without_the_separator_is_refused(fake_gpu):
    """``mpsrun tune python x.py`` (no ``--``): one line saying where the command goes, exit 2."""
    out = _tune("--ranks", "1", sys.executable, "-c", "pass")
    assert out.returncode == 2 and "put the command after --" in out.stderr and len(out.stderr.splitlines()) == 1


def test_the_budget_leaves_out_what_it_cannot_reach_and_says_which(fake_gpu):
    """With a budget below the grid's estimate, the settings with the most ranks are left out, named, and the rest
    still measured and judged (priced from the warm-up: three runs of 64 ranks cannot fit 60 s, three of one rank
    do even on a loaded machine; with 10 s a loaded machine left out even the one rank)."""
    program = "import time; time.sleep(0.3); print('rate: 1')"
    out = _tune("--ranks", "1,64", "--mps", "off", "--repeats", "3", "--budget", "60", "--json", "--", sys.executable,
                "-c", program)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["dropped"] == [{"ranks": 64, "mps": "off", "thread_percentage": None, "queues": None}]
    assert [t["ranks"] for t in result["trials"]] == [1] and "leaves out -np 64 --mps off" in out.stderr
    settle(fake_gpu)


def test_an_interrupt_stops_cleanly_and_shows_what_was_measured(fake_gpu, short_tmp):
    """SIGINT during a trial: the running job is stopped (nothing left behind), the trials measured until then are
    shown, and tune exits 130."""
    program = (f"import os, time; open(os.path.join({str(short_tmp)!r}, str(time.time())), 'w').close(); "
               "time.sleep(0.2 if os.environ['WORLD_SIZE'] == '1' else 60); print('rate: 1')")
    job = subprocess.Popen([*MPSRUN, "tune", "--ranks", "1,2", "--mps", "off", "--repeats", "1", "--metric",
                            r"rate: (\S+)", "--", sys.executable, "-c", program], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.iterdir())) >= 4, what="the two-rank trial did not start", proc=job)
    time.sleep(0.2)  # the ranks are in their sleep
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert "interrupted by SIGINT" in out and "-np 2 --mps off" in out and "run: mpsrun -np 1 --mps off" in out, out
    settle(fake_gpu)


def test_the_python_api_returns_the_trials_and_the_best(fake_gpu):
    """``mpsrun.tune`` takes lists as Python values and returns every trial and the recommendation; bad values
    raise ConfigError before anything runs."""
    result = mpsrun.tune([sys.executable, "-c", MPS_WINS], ranks=2, mps=["on", "off"], repeats=1,
                         metric=r"rate: (\S+)")
    assert [(t.setting.ranks, t.setting.mps) for t in result.trials] == [(2, "on"), (2, "off")]
    assert result.recommended is result.best and result.best.setting.ranks == 2 and result.best.median == 200
    with pytest.raises(ConfigError):
        mpsrun.tune(["true"], ranks=[0])
    settle(fake_gpu)


#: Each rank prints one more than its hardware queues (CUDA_DEVICE_MAX_CONNECTIONS; 0 where not set), in one write.
QUEUES_SEEN = ("import os; os.write(1, ('rate: %d\\n' % (1 + int(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 0))))"
               ".encode())")


def test_queue_counts_are_tried_under_mps_as_the_queues_option_sets_them(fake_gpu, monkeypatch):
    """--queues default,auto,2 tries each rank's hardware queues as mpsrun's --queues sets them, with MPS only:
    default leaves the caller's own CUDA_DEVICE_MAX_CONNECTIONS (5), auto plans 8 for 2 ranks on a GPU, 2 gives 2;
    the caller's MPSRUN_QUEUES reaches no trial, and the table and the JSON name each trial's count."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "5")
    monkeypatch.setenv("MPSRUN_QUEUES", "1")
    out = _tune("--ranks", "2", "--mps", "on,off", "--queues", "default,auto,2", "--repeats", "1", "--metric",
                r"rate: (\S+)", "--json", "--", sys.executable, "-c", QUEUES_SEEN)
    assert out.returncode == 0, out.stderr
    trials = json.loads(out.stdout)["trials"]
    assert [(t["mps"], t["queues"], t["throughput"]) for t in trials] == [
        ("on", None, 12), ("on", "auto", 18), ("on", 2, 6), ("off", None, 12)]
    table = format_report(TuneResult.from_json(json.loads(out.stdout)), 1)
    assert "queues" in table.splitlines()[1], table
    assert "run: mpsrun -np 2 --mps on --queues auto --" in table, table
    settle(fake_gpu)


def test_tunes_recommended_command_runs_with_the_queues_it_measured(fake_gpu, monkeypatch):
    """The caller has CUDA_DEVICE_MAX_CONNECTIONS=5 and MPSRUN_QUEUES=1; --queues default,2 finds default (the
    caller's 5) best. The command tune recommends, run as printed in the same shell, gives each rank the 5 that was
    measured: it runs without MPSRUN_QUEUES, as the trials did."""
    import shlex

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "5")
    monkeypatch.setenv("MPSRUN_QUEUES", "1")
    out = _tune("--ranks", "2", "--mps", "on", "--queues", "default,2", "--repeats", "1", "--metric",
                r"rate: (\S+)", "--json", "--", sys.executable, "-c", QUEUES_SEEN)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    words = shlex.split(result["command"])
    assert words[:4] == ["env", "-u", "MPSRUN_QUEUES", "mpsrun"], words
    again = subprocess.run([*words[:3], *MPSRUN, *words[4:]], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert sorted(again.stdout.split()) == ["6", "6", "rate:", "rate:"], (result["command"], again.stdout)
    settle(fake_gpu)


@pytest.mark.parametrize("printed", ["v=", "v=inf"])
def test_a_metric_that_is_no_finite_number_ends_tune_at_the_warm_up(fake_gpu, printed):
    """A --metric group that matched nothing, or a value that is not a finite number: the warm-up gives no
    throughput, so tune says why in one line and exits 3 before any trial (it was a traceback, or NaN in the table
    and invalid JSON; then every trial ran to the same 'no number')."""
    out = _tune("--ranks", "1", "--mps", "off", "--repeats", "1", "--metric", r"v=(\S+)?", "--json", "--",
                sys.executable, "-c", f"print({printed!r})")
    assert out.returncode == 3 and out.stdout == "", out.stderr
    assert "warm-up (-np 1 --mps off) gave no throughput: no number matching --metric" in out.stderr, out.stderr
    assert "trial 1 of" not in out.stderr
    settle(fake_gpu)


def test_a_failing_warm_up_ends_tune_before_its_trials(fake_gpu):
    """A job that fails in the warm-up would fail in every trial: tune says so with the job's own summary and exits 3
    (it said 'warm-up ...: 0.24 s, not counted' and ran every trial)."""
    out = _tune("--ranks", "1,2", "--", sys.executable, "-c", "raise SystemExit(4)")
    assert out.returncode == 3, out.stderr
    assert "the warm-up (-np 1 --mps on) failed (exit 4): rank 0" in out.stderr, out.stderr
    assert "not counted" not in out.stderr and "trial 1 of" not in out.stderr
    settle(fake_gpu)


def test_an_empty_metric_is_a_usage_error(fake_gpu):
    """``--metric ''`` matches anything and finds no number: one line, exit 2, nothing run (it ran the warm-up and
    all 24 trials, then exited 3)."""
    out = _tune("--metric", "", "--", "true")
    assert out.returncode == 2 and "--metric needs a regular expression" in out.stderr, out.stderr
    assert not fake_gpu.session_dirs()


def test_settings_with_mps_on_are_left_out_where_mps_cannot_run(no_gpu):
    """Where MPS cannot run (no driver, no control program), the --mps on settings are left out and said once, as
    tune's (a usage error comes alone: it came second, after that note); with only those asked for, tune exits 3 at
    once (each trial failed as the first did)."""
    out = _tune("--ranks", "1", "--repeats", "1", "--", sys.executable, "-c", "pass")
    assert out.returncode == 0 and "mpsrun tune: the settings with --mps on are left out: MPS cannot run here" \
        in out.stderr, out.stderr
    assert "-np 1 --mps on" not in out.stdout, out.stdout
    out = _tune("--repeats", "0", "--", sys.executable, "-c", "pass")  # a usage error is one line, said first
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "--repeats" in out.stderr, out.stderr
    out = _tune("--ranks", "1", "--mps", "on", "--", sys.executable, "-c", "pass")
    assert out.returncode == 3 and "every setting asks for MPS, which cannot run here" in out.stderr, out.stderr


def test_a_command_the_warm_up_cannot_run_ends_tune_with_its_code(fake_gpu):
    """A command that is not there: the warm-up says so, in one line, and tune exits 127 (it ran every trial and
    exited 3)."""
    out = _tune("--ranks", "1,2", "--", "/nonexistent/program")
    assert out.returncode == 127 and "warm-up could not run the job" in out.stderr, out.stderr
    assert "trial 1 of" not in out.stderr
    settle(fake_gpu)


def test_job_options_mpsrun_refuses_end_tune_at_the_warm_up(fake_gpu):
    """A job option mpsrun refuses when the job starts (--gpus 9 on a one-GPU machine): tune says so in one line
    and exits 2 after the warm-up (it reported the warm-up as timed, ran every trial to 'failed, exit 2', and
    exited 3)."""
    out = _tune("--ranks", "1,2", "--repeats", "1", "--gpus", "9", "--", "true")
    assert out.returncode == 2 and "warm-up could not run the job" in out.stderr, out.stderr
    assert "trial 1 of" not in out.stderr and "not counted" not in out.stderr, out.stderr
    settle(fake_gpu)


def test_a_module_with_no_arguments_is_a_command(fake_gpu):
    """``mpsrun tune ... -m MODULE --``: the module is the command, as for mpsrun itself."""
    out = _tune("--ranks", "1", "--mps", "off", "--repeats", "1", "-m", "this", "--")
    assert out.returncode == 0 and "run: mpsrun -np 1 --mps off -m this" in out.stdout, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("kwargs", [
    {"command": "true"}, {"options": "--gpus 0"}, {"options": [1]}, {"ranks": "x"}, {"mps": None},
    {"progress": 5}, {"metric": 5}, {"repeats": 10**6},
])
def test_the_python_api_refuses_bad_values_before_anything_runs(fake_gpu, kwargs):
    """Text where a list is needed, lists of non-strings, a progress that cannot be called: ConfigError before any
    trial (``tune("true")`` ran the letters t, r, u, e)."""
    arguments = {"command": ["true"], **kwargs}
    with pytest.raises(ConfigError):
        mpsrun.tune(arguments.pop("command"), **arguments)
    assert not fake_gpu.session_dirs()


@pytest.mark.parametrize("given", [["--queues", "4"], ["--queues=auto"]])
def test_the_queues_among_the_job_options_are_refused(fake_gpu, short_tmp, given):
    """``mpsrun.tune(..., options=["--queues", "4"])``: tune sets --queues in each trial, so a job option would
    override every trial's count after it (the default and auto trials all ran with 4, labelled otherwise), as the
    epilog says it must not: ConfigError naming --queues, as for --thread-percentage, and no trial ran."""
    marker = short_tmp / "ran"
    with pytest.raises(ConfigError, match="mpsrun tune sets --queues in each trial"):
        mpsrun.tune([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], ranks=1, mps="on",
                    queues="default,8", options=given, repeats=1)
    assert not marker.exists() and not fake_gpu.session_dirs()


def test_the_python_api_takes_none_as_the_default_queues(fake_gpu, monkeypatch):
    """``mpsrun.tune(..., queues=[None, 2])``: None is "not set", as for a thread percentage (and as a Setting's
    queues read), so the trials are the default and 2; it was refused ("--queues must be a positive whole number,
    not 'none'"), and so was ``queues=None``."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    result = mpsrun.tune([sys.executable, "-c", QUEUES_SEEN], ranks=2, mps="on", queues=[None, 2], repeats=1,
                         metric=r"rate: (\S+)")
    assert [(t.setting.queues, t.median) for t in result.trials] == [(None, 2), (2, 6)]
    result = mpsrun.tune([sys.executable, "-c", QUEUES_SEEN], ranks=1, mps="on", queues=None, repeats=1,
                         metric=r"rate: (\S+)")
    assert [t.setting.queues for t in result.trials] == [None]
    settle(fake_gpu)


def test_a_farm_is_tuned_by_its_tasks_per_second(fake_gpu, tmp_path):
    """``mpsrun tune --ranks 1,2 --tasks FILE``: each trial runs the whole farm with that many slots, its throughput
    is the list's tasks per farm second, and the command to run is the farm's (no command after ``--``); ``--tasks -``
    is refused (each trial reads the list again)."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text(f"{sys.executable} -c 'import time; time.sleep(0.3)'\n" * 4)
    out = _tune("--ranks", "1,2", "--mps", "on", "--repeats", "1", "--json", "--tasks", str(tasks))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["job"]["tasks"] == 4 and result["scaling"] == "weak"
    for trial in result["trials"]:
        assert trial["throughputs"][0] == pytest.approx(4 / trial["seconds"][0]), trial
    assert result["command"] in (f"mpsrun -np {n} --mps on --tasks {tasks}" for n in (1, 2)), result["command"]
    refused = _tune("--ranks", "1,2", "--tasks", "-")
    assert refused.returncode == 2 and "give --tasks a file" in refused.stderr, refused.stderr
    settle(fake_gpu)
