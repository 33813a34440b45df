"""Usage errors say what the user meant, in one line, exit 2 (issue 36, B6-B9 and A4).

Measured before: `--np 4` was "did you mean --mps?", torchrun's `--nproc-per-node` was "did you mean --per-node?",
`--grace -1` "must be a number of seconds below 1,000,000,000", `env.py` alone "command not found", `--hosts
localhost:0` reached Hydra (SIGFPE, exit 136) and a huge slot count made it spin a core, the subcommands printed
argparse's usage block, and `--mps off` said "running without MPS: MPS is off".

Also: quirky values refused, options that do nothing said to do nothing, and any command line at all (fuzzed) ending
in a documented code with one line, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPSRUN, mpiexec, mpsrun, settle, wait_processes_gone
from helpers import mpsrun as run
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


def one_line(out) -> str:
    """The command's single line on stderr, for an exit 2."""
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize(("hosts", "said"), [
    ("localhost:0", "'localhost:0' gives a host 0 slots; a host has 1 to 1,048,576"),
    ("localhost:99999999999999999999", "a host has 1 to 1,048,576"),
    ("a" * 300, "is longer than a host name can be (253 characters, 63 between dots)"),
])
def test_hosts_with_impossible_slots_or_names_are_usage_errors(fake_gpu, hosts, said):
    """--hosts with 0 or absurd slots, or a name no host can have, is refused before mpiexec starts: one line, exit 2
    (it was exit 136 from Hydra's SIGFPE, a spinning Hydra, or ssh's 6 lines)."""
    assert said in one_line(mpsrun("-np", "1", "--hosts", hosts, "true"))


@pytest.mark.parametrize("line", ["localhost:0", "localhost slots=99999999999999999999"])
def test_host_file_slot_counts_are_checked(fake_gpu, short_tmp, line):
    """A host file's slot counts are checked as --hosts' are: one line, exit 2."""
    hostfile = short_tmp / "hosts"
    hostfile.write_text(f"# the nodes\n{line}\n")
    assert "slots; a host has 1 to 1,048,576" in one_line(mpsrun("--hostfile", hostfile, "true"))


@pytest.mark.parametrize("where", ["--hosts", "--hostfile"])
def test_slot_counts_in_other_scripts_digits_are_refused(fake_gpu, short_tmp, where):
    """A slot count written in digits other than 0-9 (Arabic-Indic three) is refused, exit 2: a regular expression's
    \\d let it through, and Hydra then died of SIGFPE (exit 136)."""
    hostfile = short_tmp / "hosts"
    hostfile.write_text("localhost:\u0663\n")
    value = "localhost:\u0663" if where == "--hosts" else str(hostfile)
    assert "localhost:\u0663" in one_line(mpsrun("-np", "1", where, value, "true"))


def test_a_host_file_that_is_not_a_file_is_refused(fake_gpu, short_tmp):
    """A FIFO as host file is refused, exit 2 (mpsrun waited for a writer for ever, and reads the file more than
    once, which a pipe cannot give)."""
    os.mkfifo(short_tmp / "hosts")
    assert "is a pipe, which can be read only once" in one_line(mpsrun("-np", "1", "--hostfile", short_tmp / "hosts",
                                                                        "true"))


@pytest.mark.parametrize("given", ["option", "variable"])
def test_a_host_file_that_is_a_device_is_refused(fake_gpu, given):
    """--hostfile /dev/zero (or MPSRUN_HOSTFILE=/dev/zero with --dry-run) is refused as a FIFO is, one line and exit 2,
    within a memory limit: mpsrun read the device without end (the OOM killer, or a MemoryError traceback)."""
    def limited() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    argv = ["--hostfile", "/dev/zero", "-np", "1", "true"] if given == "option" else ["--dry-run", "-np", "1", "true"]
    env = {**os.environ, "MPSRUN_HOSTFILE": "/dev/zero"} if given == "variable" else None
    assert "host file '/dev/zero' is not a regular file" in one_line(mpsrun(*argv, timeout=60, env=env,
                                                                            preexec_fn=limited))


def test_an_empty_host_file_is_refused(fake_gpu, short_tmp):
    """An empty host file (a regular one: /dev/null is a device, refused as such) names no host: one line, exit 2."""
    (short_tmp / "hosts").write_text("# no host yet\n")
    assert "names no host" in one_line(mpsrun("-np", "1", "--hostfile", short_tmp / "hosts", "true"))


def test_a_host_file_larger_than_any_is_refused(fake_gpu, short_tmp):
    """A host file of more than 16 MiB (no list of hosts is) is refused in one line, exit 2, without being read."""
    with open(short_tmp / "hosts", "wb") as hosts:
        hosts.truncate((16 << 20) + 1)
    assert "larger than 16777216 bytes" in one_line(mpsrun("-np", "1", "--hostfile", short_tmp / "hosts", "true"))


def test_open_mpis_host_file_form_is_refused_for_mpich(fake_gpu, short_tmp, monkeypatch):
    """`host slots=N`, Open MPI's host file form, given to MPICH's mpiexec is refused before it starts, exit 2 (Hydra
    printed nine lines of 'token slots not supported' and exited 255)."""
    monkeypatch.setenv("PATH", f"{Path(mpiexec()).parent}{os.pathsep}{os.environ['PATH']}")
    (short_tmp / "hosts").write_text("localhost slots=2\n")
    line = one_line(mpsrun("-np", "1", "--hostfile", short_tmp / "hosts", "--mpiexec", mpiexec(), "true"))
    assert "'localhost slots=2' is Open MPI's form; the mpiexec of MPICH and Intel MPI takes host or host:N" in line


def test_an_empty_module_name_is_refused(fake_gpu):
    """`-m ''` is a usage error, exit 2 (it ran, and every rank failed with an ImportError)."""
    assert "-m: value needs a Python module name" in one_line(mpsrun("-np", "1", "-m", ""))


def test_a_script_that_is_not_executable_is_told_how_to_run(fake_gpu, short_tmp):
    """`mpsrun -np 2 ./x.py` on a script without the execute bit says `did you mean python ./x.py?`, exit 126."""
    (short_tmp / "x.py").write_text("print(1)\n")
    out = mpsrun("-np", "2", "--launcher", "local", "./x.py", cwd=short_tmp)
    assert out.returncode == 126 and "./x.py: Permission denied (did you mean python ./x.py?)" in out.stderr, out.stderr


def test_open_mpis_np_spelling_is_taken(fake_gpu):
    """--np N runs N ranks, as Open MPI's mpirun takes it (it said 'did you mean --mps?')."""
    out = mpsrun("--np", "2", "--launcher", "local", sys.executable, "-c",
                 "import os; os.write(1, os.environ['WORLD_SIZE'].encode() + b'\\n')")
    assert out.returncode == 0 and out.stdout.split() == ["2", "2"], out.stderr


@pytest.mark.parametrize(("words", "said"), [
    (["--nproc-per-node", "4"], "torchrun's --nproc-per-node is mpsrun's -np N, the ranks on this node"),
    (["--nproc_per_node=4"], "torchrun's --nproc_per_node is mpsrun's -np N, the ranks on this node"),
    (["--nnodes", "2"], "for several nodes, use --hosts A,B, or start mpsrun --per-node under srun or mpiexec"),
    (["--grace", "-1"], "must be 0 or more seconds"),
    (["-N", "4"], "Slurm's -N, nodes, is --hosts A,B, or srun -N M mpsrun --per-node; Open MPI's -N, ranks on this "
                  "node, is -np N"),
    (["-N4"], "Open MPI's -N, ranks on this node, is -np N"),
    (["-c", "4"], "Open MPI's -c is mpsrun's -np N; Slurm's -c, CPUs per rank, is srun's: srun -c C mpsrun --per-node"),
])
def test_other_launchers_habits_get_mpsruns_words(fake_gpu, words, said):
    """An option of torchrun's, Slurm's or Open MPI's (or a negative --grace) is answered with what mpsrun takes
    instead, not with the closest spelling of an unrelated option (-N and -c had no word at all)."""
    line = one_line(mpsrun(*words, "true"))
    assert said in line and "did you mean --per-node" not in line, line


@pytest.mark.parametrize("exists", [True, False])
def test_a_script_named_as_a_command_is_told_how_to_run(fake_gpu, short_tmp, exists):
    """`mpsrun -np 2 env.py` says `did you mean python env.py?` (it said only 'command not found'), exit 127."""
    if exists:
        (short_tmp / "env.py").write_text("print(1)\n")
    out = mpsrun("-np", "2", "env.py", cwd=short_tmp)
    assert out.returncode == 127
    assert out.stderr.strip().endswith("env.py: command not found (did you mean python env.py?)"), out.stderr


@pytest.mark.parametrize("words", [["bench", "--ranks", "x"], ["bench", "--repeats", "0"], ["bench", "--bogus"],
                                   ["status", "--bogus"], ["doctor", "--bogus"], ["cleanup", "--bogus"]])
def test_subcommands_usage_errors_are_one_line(fake_gpu, words):
    """Every subcommand answers a bad option in one line and exit 2, as the main command does (bench printed 4 lines
    of usage, status and doctor 2)."""
    line = one_line(mpsrun(*words))
    assert line.startswith(f"mpsrun {words[0]}: error: ") and line.endswith(f"(see mpsrun {words[0]} --help)"), line


def test_mps_off_asked_for_is_not_announced(fake_gpu):
    """--mps off runs without MPS as asked, saying nothing of it; an option that has no effect then is still
    named."""
    out = mpsrun("-np", "2", "--mps", "off", "--launcher", "local", "true")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    out = mpsrun("-np", "2", "--mps", "off", "--thread-percentage", "50", "--launcher", "local", "true")
    assert out.stderr.splitlines() == ["mpsrun: warning: --thread-percentage has no effect without MPS"], out.stderr


@pytest.mark.parametrize("words", [["doctor", "--json"], ["status", "--json"]])
def test_output_into_a_closed_pipe_ends_quietly(no_gpu, words):
    """A reader that has gone (``mpsrun doctor --json | head``) ends the command as a shell's command ends, 141, with
    no traceback (doctor printed one)."""
    import os
    import subprocess

    read, write = os.pipe()
    os.close(read)
    out = subprocess.run([sys.executable, "-m", "mpsrun", *words], stdout=write, stderr=subprocess.PIPE, text=True,
                         timeout=60)
    os.close(write)
    assert "Traceback" not in out.stderr and out.returncode == 141, (out.returncode, out.stderr)


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("words", [["top", "--once"], ["top", "--json"], ["status"], ["status", "--json"], ["doctor"],
                                   ["cleanup"]])
def test_output_onto_a_full_device_is_one_line_and_exit_3(fake_gpu, words, buffered):
    """stdout on /dev/full (every write: ENOSPC), as an unbuffered (PYTHONUNBUFFERED) or block-buffered Python writes
    it: the subcommand says so in one line, exit 3, as what the machine refuses is on a job's path. It ended in an
    OSError traceback (exit 1), or, block-buffered, exited 0 with its output lost unsaid."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED" or not buffered}
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "mpsrun", *words], stdout=full, stderr=subprocess.PIPE, text=True,
                             timeout=120, env=env)
    assert out.returncode == 3 and out.stderr == "mpsrun: error: No space left on device\n", (out.returncode,
                                                                                                out.stderr[-2000:])


def test_a_mistyped_option_gets_a_suggestion():
    """An unknown option near a known one is answered with the known one, exit 2."""
    out = mpsrun("--tag-ouput", "-np", "1", "true")
    assert out.returncode == 2
    assert "did you mean --tag-output?" in out.stderr


def test_np_glued_to_its_number(no_gpu):
    """``-np4`` is four ranks (it was refused as ``not 'p4'``)."""
    out = mpsrun("-np4", "--launcher", "local", sys.executable, "-c",
                 "import os; os.write(1, os.environ['WORLD_SIZE'].encode() + b'\\n')")  # one write: lines never mix
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4"] * 4


def test_help_fits_a_terminal():
    """``--help`` has no line longer than 110 characters (the variables' line had 377) and names bench's options."""
    out = mpsrun("--help")
    assert out.returncode == 0
    assert max(map(len, out.stdout.splitlines())) <= 110
    assert "mpsrun bench [--ranks 1,2,4,8,16] [--repeats 3]" in out.stdout


def test_verbose_without_a_gpu_says_what_happened(no_gpu):
    """``-v`` without a GPU says ``no GPU`` and no daemon (it said ``GPU -`` and ``daemons ready``)."""
    out = mpsrun("-v", "-np", "2", "--launcher", "local", sys.executable, "-c", "pass")
    assert out.returncode == 0, out.stderr
    assert "rank 1: no GPU" in out.stderr and "set up without MPS after" in out.stderr, out.stderr
    assert "GPU -" not in out.stderr and "daemons ready" not in out.stderr


def test_mps_session_says_a_named_gpu_is_ignored_without_a_driver(no_gpu):
    """``mps_session(gpu=5)`` without a driver runs without MPS and says that GPU 5 is ignored."""
    code = "from mpsrun import mps_session\nwith mps_session(gpu=5) as session:\n    assert not session.enabled\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "running without MPS" in out.stderr and "GPU 5 ignored" in out.stderr, out.stderr


@pytest.mark.parametrize("gpus", ["5", "GPU-abc"])
def test_gpus_named_without_a_driver_are_said_to_have_no_effect(no_gpu, gpus):
    """``--gpus 5`` or ``--gpus GPU-abc`` on a machine without a driver: the job runs (as without MPS) and a
    warning says that --gpus has no effect (there was no word at all)."""
    out = mpsrun("--gpus", gpus, "-np", "2", "--launcher", "local", sys.executable, "-c", "print(1)")
    assert out.returncode == 0, out.stderr
    assert "warning: --gpus has no effect without MPS and a GPU" in out.stderr, out.stderr


def test_a_line_of_ours_is_cut_however_long_what_it_quotes(fake_gpu, short_tmp):
    """What a line of ours quotes (a host file's line, a value given) is cut: the line stays within LINE_MOST
    characters (a 15 MB host file of NULs was one 63 MB line, a 120 kB --gpus value one 120 kB line)."""
    from mpsrun.runtime.output import LINE_MOST

    hostfile = short_tmp / "hosts"
    with hostfile.open("wb") as stream:
        stream.truncate(15 << 20)
    for out in (mpsrun("--hostfile", str(hostfile), "--launcher", "mpiexec", "-np", "2", "true"),
                mpsrun("--gpus", "1" * 120_000, "-np", "1", "true")):
        assert len(one_line(out)) <= LINE_MOST and out.stderr.endswith("...\n"), out.stderr[:300]


@pytest.mark.parametrize("command", ["cleanup --force", "top --once"])
def test_a_session_named_with_escapes_is_not_printed_raw(fake_gpu, command):
    """A session or job named with a terminal escape and a newline (a rank can name a directory so, and a script
    passes on what `mpsrun status --json` lists): the one line says it escaped (both printed it raw)."""
    line = one_line(mpsrun(*command.split(), "x\x1b[2J\nsecond"))
    assert "\x1b" not in line and "x\\x1b[2J\\nsecond" in line, line


_FROM_A_REMOVED_DIRECTORY = ("import os, sys\nos.mkdir(sys.argv[1])\nos.chdir(sys.argv[1])\nos.rmdir(sys.argv[1])\n"
                             "os.execv(sys.executable, [sys.executable, '-m', 'mpsrun', *sys.argv[2:]])\n")


@pytest.mark.parametrize("options", [["--report", "r.json", "true"], ["--output-filename", "out", "true"],
                                     ["--tasks", "tasks.txt"], ["--results", "r.jsonl", "--array", "0-1", "true"]])
def test_a_relative_path_in_a_removed_working_directory_is_named(fake_gpu, tmp_path, options):
    """A relative path given to an option while the working directory has been removed: exit 2 and one line that
    names the option and why (it was 'mpsrun: error: No such file or directory', exit 3: found by the fifth hostile
    pass)."""
    out = subprocess.run([sys.executable, "-c", _FROM_A_REMOVED_DIRECTORY, str(tmp_path / "gone"), "-np", "1",
                          "--launcher", "local", *options], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                              "PWD": str(tmp_path / "gone")})  # (as a shell that was there says it)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and options[0] in out.stderr, out.stderr
    assert f"working directory ({tmp_path / 'gone'}) was removed" in out.stderr, out.stderr


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
