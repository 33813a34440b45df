"""mpsrun.Executor on the fake GPU: results and their order, each worker's placement, exceptions with the worker's
traceback, a worker killed (only its own future fails; a fresh worker takes its place), shutdown with and without
waiting, MPS proof in the accounts, no GPU; and nothing left behind (the fake_gpu fixture checks)."""

import concurrent.futures
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import executor_calls as calls
import psutil
import pytest
from helpers import FAKE_MPS, settle, wait_for

import mpsrun


def test_map_gives_every_result_in_order_from_workers_placed_as_ranks(fake_gpu):
    """map over 12 calls on 2 workers with thread_percentage auto: the results in the calls' order, each worker a
    client of the session's MPS daemon for GPU 0 with 50% of the SMs (the same plan as a 2-rank job's)."""
    with mpsrun.Executor(workers=2, thread_percentage="auto") as executor:
        results = list(executor.map(calls.placed, range(12)))
        pipe = str(executor.session.dirs.pipe_dir(0))
    assert [r[0] for r in results] == [x * x for x in range(12)]
    assert {(r[1], r[2], r[3]) for r in results} == {(pipe, "50", fake_gpu.uuids[0])}
    assert not fake_gpu.session_dirs()


def test_a_calls_exception_reaches_its_future_with_the_workers_traceback(fake_gpu):
    """A call that raises: its future raises the same exception, whose __cause__ is the worker's traceback (naming
    the function's line); the other calls succeed."""
    with mpsrun.Executor(workers=2) as executor:
        failing, fine = executor.submit(calls.fails, 7), executor.submit(calls.placed, 3)
        with pytest.raises(ValueError, match="call 7 failed here") as raised:
            failing.result(timeout=60)
        assert fine.result(timeout=60)[0] == 9
    cause = str(raised.value.__cause__)
    assert "Traceback" in cause and 'raise ValueError(f"call {x} failed here")' in cause, cause


def test_an_exception_its_pickle_cannot_make_again_is_said_with_the_workers_traceback(fake_gpu):
    """A call that raises an exception whose __init__ takes other arguments than its args (pickle cannot make it
    again): its future fails with a TypeError naming the exception and its message, the worker's traceback as its
    __cause__, and the worker serves on. The future got the TypeError of the failed rebuild, with no traceback."""
    with mpsrun.Executor(workers=1) as executor:
        failed = executor.submit(calls.fails_unrebuildably, 7).exception(timeout=60)
        assert executor.submit(calls.placed, 3).result(timeout=60)[0] == 9
    assert isinstance(failed, TypeError)
    assert str(failed).startswith("the call's outcome cannot be sent back: TwoArgumentError: call 7 failed here: "), \
        failed
    assert 'raise TwoArgumentError(f"call {x} failed here", 2)' in str(failed.__cause__), failed.__cause__


def test_a_killed_worker_fails_only_its_own_future_and_is_replaced(fake_gpu):
    """A worker SIGKILLed while it runs a call: that future fails with WorkerDiedError naming the worker, its GPU and
    the signal; the calls around it and after it succeed, on a fresh worker in its place."""
    with mpsrun.Executor(workers=2) as executor:
        before = [executor.submit(calls.placed, x) for x in range(4)]
        dead = executor.submit(calls.dies, 0)
        with pytest.raises(mpsrun.WorkerDiedError) as died:
            dead.result(timeout=60)
        after = list(executor.map(calls.placed, range(6)))
        concurrent.futures.wait(before, timeout=60)  # (a worker slow to answer may still hold one of them)
        accounts = executor.accounts()
    assert [f.result(timeout=60)[0] for f in before] == [0, 1, 4, 9] and [r[0] for r in after] == [0, 1, 4, 9, 16, 25]
    error = died.value
    assert error.returncode == -signal.SIGKILL and error.gpu == 0 and error.worker in (0, 1)
    assert "was killed by signal 9 (SIGKILL) while it ran this call" in str(error)
    assert sum(a.processes for a in accounts) == 3 and sum(a.failed for a in accounts) == 1
    assert sum(a.calls for a in accounts) == 11


def test_shutdown_without_waiting_cancels_what_has_not_started(fake_gpu, tmp_path):
    """shutdown(wait=False, cancel_futures=True) while one call runs and others wait: the waiting ones are cancelled,
    the running one finishes, and the workers and the session then go (the fixture finds nothing left)."""
    release = tmp_path / "release"
    executor = mpsrun.Executor(workers=1)
    running = executor.submit(calls.waits_for, str(release))
    waiting = [executor.submit(calls.placed, x) for x in range(5)]
    deadline = time.monotonic() + 60
    while not running.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    executor.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in waiting)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(calls.placed, 1)
    release.touch()
    assert running.result(timeout=60) is True
    deadline = time.monotonic() + 30
    while (fake_gpu.session_dirs() or executor._manager.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fake_gpu.session_dirs()


def test_the_accounts_prove_each_worker_an_mps_client(fake_gpu):
    """Two workers that became clients of the session's server (their first CUDA call) are proven so in accounts(),
    with their calls, time alive, CPU and device memory peak (sampled while they run a call: their contexts)."""
    with mpsrun.Executor(workers=2) as executor:
        clients = [executor.submit(calls.cuda_client, str(FAKE_MPS), 1.0) for _ in range(2)]  # one on each worker
        pids = {future.result(timeout=60) for future in clients}
        for future in concurrent.futures.as_completed([executor.submit(calls.sleeps, 0.7) for _ in range(4)]):
            pids.add(future.result())
        accounts = executor.accounts()
    assert [a.mps for a in accounts] == [True, True], accounts
    assert sum(a.calls for a in accounts) == 6, accounts  # (how the sleeps fell between the workers is the OS's)
    assert all(a.calls >= 1 and a.wall > 0 and a.cpu is not None and a.cpu > 0 for a in accounts), accounts
    assert all(a.memory_peak is not None and a.memory_peak >= 500 for a in accounts), accounts  # a context each


def test_without_a_gpu_the_workers_are_plain_processes_said_once(no_gpu, caplog):
    """No driver (mps="auto"): the workers run the calls as plain processes, with no MPS variable, and the executor
    says once why it runs without MPS; with mps="on" it refuses, before any worker starts."""
    with caplog.at_level(logging.WARNING, logger="mpsrun"), mpsrun.Executor(workers=2) as executor:
        results = list(executor.map(calls.placed, range(4)))
        assert not executor.session.enabled
    assert [r[0] for r in results] == [0, 1, 4, 9] and {r[1] for r in results} == {None}
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "running without MPS" in caplog.records[0].getMessage()
    with pytest.raises(mpsrun.MPSError):
        mpsrun.Executor(workers=1, mps="on")
    assert os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is None


def test_a_fatal_fault_costs_only_the_call_that_made_it(fake_gpu, tmp_path):
    """4 workers on one GPU: call 3 makes a fatal fault while calls 0-2 run kernels, and the server tears all four
    down. Calls 0-2 run again, one at a time alone on fresh workers, and succeed; call 3 faults again alone and its
    future fails with its CUDA error, noted as the fault's own; the broken workers are replaced."""
    marks = tmp_path / "marks"
    marks.mkdir()
    with mpsrun.Executor(workers=4) as executor:
        futures = [executor.submit(calls.kernels_until_fault, str(FAKE_MPS), str(marks), call == 3, 3)
                   for call in range(4)]
        done = [f.exception(timeout=120) for f in futures]
        accounts = executor.accounts()
    assert done[:3] == [None, None, None], done
    assert isinstance(done[3], RuntimeError) and "CUDA error" in str(done[3])
    assert "this call caused a fatal GPU fault (it ran alone" in "".join(getattr(done[3], "__notes__", [])), done[3]
    assert sum(a.failed for a in accounts) == 1 and sum(a.processes for a in accounts) > 4, accounts


def test_calls_left_when_a_worker_dies_during_shutdown_still_run(fake_gpu):
    """shutdown() while the one worker runs a call that kills it and three calls wait: a fresh worker still takes
    the waiting calls (before, none was started once shutting down, and shutdown waited for ever)."""
    executor = mpsrun.Executor(workers=1)
    dead = executor.submit(calls.dies, 0)
    waiting = [executor.submit(calls.placed, x) for x in range(3)]
    executor.shutdown(wait=True)
    assert isinstance(dead.exception(timeout=1), mpsrun.WorkerDiedError)
    assert [f.result(timeout=1)[0] for f in waiting] == [0, 1, 4]


def test_a_worker_that_died_idle_fails_no_call(fake_gpu):
    """A worker killed between calls, the next call submitted at once: it runs on the fresh worker in its place and
    succeeds (it was sent to the dying worker and failed with WorkerDiedError, 20 times in 20); a call that kills its
    worker still fails, as it ran."""
    with mpsrun.Executor(workers=1) as executor:
        for x in range(4):
            pid = executor.submit(calls.sleeps, 0).result(timeout=60)
            os.kill(pid, signal.SIGKILL)
            assert executor.submit(calls.placed, x).result(timeout=60)[0] == x * x
        with pytest.raises(mpsrun.WorkerDiedError):
            executor.submit(calls.dies, 0).result(timeout=60)
        assert executor.accounts()[0].failed == 1


def test_a_ctrl_c_interrupts_the_running_calls_and_spares_the_idle_workers(fake_gpu, tmp_path):
    """SIGINT to the whole process group, as a Ctrl-C at the terminal sends it: the running call's future fails with
    KeyboardInterrupt, the idle worker lives on (it died with a traceback, and the next call failed), and later calls
    succeed."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = _script(tmp_path, f"""    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the caller's own Ctrl-C is its business)
    with mpsrun.Executor(workers=2) as executor:
        idle = executor.submit(calls.sleeps, 0).result()
        running = executor.submit(calls.marks_then_sleeps, {str(marks)!r}, 60)
        while not os.listdir({str(marks)!r}):  # (the call runs in its worker)
            time.sleep(0.05)
        os.killpg(0, signal.SIGINT)
        try:
            running.result(timeout=60)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        print("later", executor.submit(calls.placed, 4).result(timeout=60)[0])
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         start_new_session=True)
    assert run.returncode == 0 and run.stdout.split("\n") == ["interrupted", "later 16", ""], (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr


def test_a_shutdown_from_a_futures_callback_still_ends_everything(fake_gpu, caplog):
    """A done-callback (it runs in the executor's manager thread) that calls shutdown(): no error, and the workers
    and the session go once the calls are done; a later shutdown() waits for that (the callback's shutdown raised
    "cannot join current thread", and every later shutdown returned at once with the workers and daemons left)."""
    executor = mpsrun.Executor(workers=1)
    done = executor.submit(calls.placed, 2)
    done.add_done_callback(lambda _: executor.shutdown())
    assert done.result(timeout=60)[0] == 4
    executor.shutdown()
    assert not fake_gpu.session_dirs() and "exception calling callback" not in caplog.text, caplog.text


@pytest.mark.parametrize("cancel", [False, True])
def test_a_shutdown_without_waiting_then_one_that_waits_end_everything_once(fake_gpu, cancel):
    """shutdown(wait=False) then shutdown(wait=True) at once, with calls running: the second waits for the first's
    end, and nothing is closed twice (an OSError traceback, Bad file descriptor, from one of the two)."""
    executor = mpsrun.Executor(workers=2)
    futures = [executor.submit(calls.sleeps, 0.2) for _ in range(4)]
    executor.shutdown(wait=False, cancel_futures=cancel)
    executor.shutdown(wait=True)
    assert all(f.done() for f in futures) and not fake_gpu.session_dirs()


def test_more_workers_on_a_gpu_than_its_mps_server_takes_are_warned_of(fake_gpu, caplog):
    """Executor(workers=50) on one GPU warns, as 50 ranks do (it said nothing); 2 workers do not."""
    with caplog.at_level(logging.WARNING, logger="mpsrun"), mpsrun.Executor(workers=50, gpus="0"):
        pass
    assert "50 workers share GPU 0, but an MPS server accepts at most 48" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mpsrun"), mpsrun.Executor(workers=2, gpus="0"):
        pass
    assert "share GPU" not in caplog.text, caplog.text


def test_an_executor_inside_a_worker_is_refused_in_words(fake_gpu):
    """A call that starts an Executor of its own fails with a RuntimeError that says why (a bare AssertionError,
    "daemonic processes are not allowed to have children", before), and its worker goes on."""
    with mpsrun.Executor(workers=1) as executor:
        with pytest.raises(RuntimeError, match="cannot start inside a worker of another"):
            executor.submit(calls.nested, 2).result(timeout=60)
        assert executor.submit(calls.placed, 3).result(timeout=60)[0] == 9


def test_what_calls_leave_running_ends_with_the_executor(fake_gpu):
    """A call that starts a process and returns without waiting for it: the process ends with the executor (it
    outlived the `with` block: a sleep of minutes, found by a hostile pass)."""
    import psutil

    with mpsrun.Executor(workers=1) as executor:
        pid = executor.submit(calls.leaves_a_process, 300).result(timeout=60)
        left = psutil.Process(pid)
    assert not left.is_running() or left.status() == psutil.STATUS_ZOMBIE


def test_a_function_the_worker_cannot_find_fails_its_call_not_the_worker(fake_gpu):
    """A function defined in ``python -c`` (the spawned worker cannot import it): the future fails with the
    unpickling error, and no worker dies (it died twice, with two tracebacks, and the future said WorkerDiedError)."""
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "import mpsrun\n"
              "def here(): return 1\n"
              "with mpsrun.Executor(workers=1) as executor:\n"
              "    try:\n"
              "        executor.submit(here).result(timeout=60)\n"
              "    except AttributeError as exc:\n"
              "        print('failed:', exc)\n"
              "    print('processes', executor.accounts()[0].processes)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "failed: Can't get attribute 'here'" in run.stdout, (run.stdout, run.stderr)
    assert "processes 1" in run.stdout and "Traceback" not in run.stderr, (run.stdout, run.stderr)


def test_a_ctrl_c_once_the_worker_took_the_call_interrupts_it_even_while_its_function_loads(fake_gpu, tmp_path):
    """A SIGINT to the group once the worker has taken the call but still imports the call's module (slow to
    import): the call is interrupted (its future fails with KeyboardInterrupt), not run to its end (the worker said
    it took the call before it listened for Ctrl-C, and the signal was lost)."""
    (tmp_path / "slow_calls.py").write_text(
        f"import os, time\nopen(os.path.join({str(tmp_path)!r}, f'importing.{{os.getpid()}}'), 'w').close()\n"
        "time.sleep(2)\ndef sleeps(s):\n    time.sleep(s)\n")
    script = tmp_path / "ctrl_c_early.py"
    script.write_text(f"""
import os, signal, sys, time
sys.path.insert(0, {str(tmp_path)!r})
import mpsrun
if __name__ == "__main__":
    import slow_calls
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with mpsrun.Executor(workers=1) as executor:
        future = executor.submit(slow_calls.sleeps, 30)
        mine = f"importing.{{os.getpid()}}"
        while not [p for p in os.listdir({str(tmp_path)!r}) if p.startswith("importing.") and p != mine]:
            time.sleep(0.01)
        os.killpg(0, signal.SIGINT)
        try:
            future.result(timeout=60)
        except KeyboardInterrupt:
            print("interrupted")
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         start_new_session=True)
    assert run.returncode == 0 and run.stdout == "interrupted\n", (run.stdout, run.stderr)


def test_two_quick_ctrl_cs_interrupt_the_calls_and_no_worker(fake_gpu, tmp_path):
    """Two SIGINTs to the process group back to back (GNU timeout passes a Ctrl-C on to its group, so each worker
    gets two) once both calls run in their workers: each call's future fails with KeyboardInterrupt, and no worker
    dies (the second landed in the first's traceback, 2 runs in 3: a worker's traceback, and WorkerDiedError)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = _script(tmp_path, f"""    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with mpsrun.Executor(workers=2) as executor:
        running = [executor.submit(calls.marks_then_sleeps, {str(marks)!r}, 30) for _ in range(2)]
        while len(os.listdir({str(marks)!r})) < 2:
            time.sleep(0.05)
        os.killpg(0, signal.SIGINT)
        os.killpg(0, signal.SIGINT)
        for future in running:
            try:
                future.result(timeout=60)
            except KeyboardInterrupt:
                print("interrupted")
        print("processes", sum(a.processes for a in executor.accounts()))
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         start_new_session=True)
    assert run.returncode == 0 and run.stdout.split("\n") == ["interrupted", "interrupted", "processes 2", ""], \
        (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr


def _script(tmp_path, body):
    script = tmp_path / "script.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "import executor_calls as calls\nimport mpsrun\nif __name__ == '__main__':\n" + body)
    return script


def test_the_workers_of_a_killed_executor_die_with_it(fake_gpu, tmp_path):
    """The executor's process SIGKILLed while its workers run calls: the workers die with it (they ran on, orphans,
    until their calls ended: hours for a long GPU call), and the session's reaper removes the rest."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = _script(tmp_path, f"""    executor = mpsrun.Executor(workers=2)
    running = [executor.submit(calls.marks_then_sleeps, {str(marks)!r}, 60) for _ in range(2)]
    time.sleep(60)
""")
    owner = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(marks.iterdir())) == 2, what="the calls did not start", proc=owner)
    owner.kill()
    owner.communicate(timeout=60)
    workers = [int(mark.name) for mark in marks.iterdir()]
    wait_for(lambda: not any(_running(pid) for pid in workers), what="a worker outlived its executor")
    settle(fake_gpu)  # (the reaper, at work)


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_calls_submitted_run_before_the_program_exits(fake_gpu, tmp_path):
    """A program that submits calls, shuts down without waiting and ends: its exit waits for the calls, as
    concurrent.futures' executors do (they were dropped, the program gone in a fraction of a second)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = _script(tmp_path, f"""    executor = mpsrun.Executor(workers=1)
    for number in range(3):
        executor.submit(calls.marks_then_sleeps, os.path.join({str(marks)!r}, str(number)), 0.3)
    executor.shutdown(wait=False)
""")
    for number in range(3):
        (marks / str(number)).mkdir()
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and all(list((marks / str(n)).iterdir()) for n in range(3)), run.stderr


def test_a_list_of_shares_not_one_per_worker_is_said_in_the_apis_words(fake_gpu):
    """Executor(workers=1, thread_percentage=[10, 20]): a ConfigError naming the argument and the workers (it said
    "--thread-percentage ... 1 ranks; give one value per rank"), before anything starts."""
    with pytest.raises(mpsrun.ConfigError, match=r"thread_percentage lists 2 values but there are 1 workers; give "
                                                 r"one value per worker"):
        mpsrun.Executor(workers=1, thread_percentage=[10, 20])
    assert not fake_gpu.session_dirs()


def test_a_worker_that_cannot_be_replaced_fails_the_calls_left_instead_of_hanging_them(fake_gpu, tmp_path):
    """A worker dies and its replacement cannot start (no descriptor left): every call not done fails with why, and
    later submits are refused (the manager thread died; submit() still took calls, whose futures never ended)."""
    script = _script(tmp_path, """    import resource
    with mpsrun.Executor(workers=1) as executor:
        executor.submit(calls.placed, 0).result(timeout=60)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 1, hard))
        dead = executor.submit(calls.dies, 0)
        try:  # (the executor may already be broken: then this submit is refused, with why)
            futures = [dead, executor.submit(calls.placed, 1)]
        except mpsrun.MPSError as exc:
            print("refused:", exc)
            futures = [dead]
        for future in futures:
            try:
                future.result(timeout=60)
            except Exception as exc:
                print(type(exc).__name__, exc)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            executor.submit(calls.placed, 2)
        except mpsrun.MPSError as exc:
            print("refused:", exc)
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.count("cannot go on") >= 2 and "refused:" in run.stdout, \
        (run.stdout, run.stderr)


def test_a_ctrl_c_as_the_workers_start_leaves_nothing_running(fake_gpu, tmp_path):
    """A KeyboardInterrupt while Executor() waits for its workers: the executor is shut down before it propagates
    (its thread, workers, daemon and session lived on, with no handle to end them)."""
    script = _script(tmp_path, """    import signal, threading
    import psutil
    def worker_started():
        try:
            return any("multiprocessing" in " ".join(c.cmdline()) for c in psutil.Process().children())
        except psutil.Error:  # (a child gone as it was read)
            return False
    def interrupt():  # once the executor's thread has started its first worker
        while not worker_started():
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        executor = mpsrun.Executor(workers=16)
        print("started")
    except KeyboardInterrupt:
        print("interrupted", [t.name for t in threading.enumerate() if t.name == "mpsrun-executor"])
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "interrupted []\n", (run.stdout, run.stderr)
    settle(fake_gpu)


def test_a_worker_whose_call_forked_is_seen_dead_at_once(fake_gpu, tmp_path):
    """A call that forks a long-lived child, then ends its worker: the future fails with WorkerDiedError at once
    (the child held the worker's sentinel pipe, and the death went unseen until it ended: 20 s, or never), and a
    fresh worker runs the next call. (The child, orphaned with its worker, is the test's to end.)"""
    try:
        with mpsrun.Executor(workers=1) as executor:
            began = time.monotonic()
            with pytest.raises(mpsrun.WorkerDiedError):
                executor.submit(calls.forks_then_dies, str(tmp_path), 30).result(timeout=60)
            assert time.monotonic() - began < 20
            assert executor.submit(calls.placed, 2).result(timeout=60)[0] == 4
    finally:
        for mark in tmp_path.iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(mark.name), signal.SIGKILL)
        settle(fake_gpu)
