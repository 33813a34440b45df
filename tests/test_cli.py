"""Unit tests: mpirun-style option parsing, environment fallbacks, usage errors."""

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsrun.cli import main
from mpsrun.config.commandline import build_parser, parse_args, split_argv
from mpsrun.config.options import JobConfig, options
from mpsrun.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "options", "command"),
    [
        (["-np", "4", "python", "sim.py", "-n", "3"], ["-np", "4"], ["python", "sim.py", "-n", "3"]),
        (["-n", "2", "--", "-weird", "x"], ["-n", "2"], ["-weird", "x"]),
        (["--tag-output", "./a.out"], ["--tag-output"], ["./a.out"]),
        (["--mem-limit=4G", "cmd"], ["--mem-limit=4G"], ["cmd"]),
        (["--mpiexec-arg", "-x", "cmd"], ["--mpiexec-arg=-x"], ["cmd"]),
        (["-np", "2", "-m", "pkg.mod", "-v", "--x"], ["-np", "2", "-m", "pkg.mod"], ["-v", "--x"]),
        (["-np", "-1", "python"], ["-np", "-1"], ["python"]),
        (["-v"], ["-v"], []),
    ],
)
def test_options_end_at_first_command_word(argv, options, command):
    """Options stop at the first non-option word, at --, or after -m MODULE; the rest is the command's."""
    assert split_argv(argv) == (options, command)


def test_full_parse_builds_config():
    """Every option lands in the job configuration with its parsed type."""
    config = parse_args(
        ["-np", "4", "--gpus", "0,GPU-ab", "--map-by", "round-robin", "--thread-percentage", "10,20,30,40",
         "--mem-limit", "1.5G", "--priority", "1", "--mps", "on", "--launcher", "local", "--mpiexec-arg",
         "--bind-to=none", "--mpiexec-arg=-x", "--tag-output", "--timeout", "30", "--grace", "0", "--keep-logs",
         "python", "x.py"],
        environ={},
    )
    assert config.command == ("python", "x.py") and config.nranks == 4
    assert config.gpus == (0, "GPU-ab") and config.map_by == "round-robin"
    assert config.thread_percentage == (10, 20, 30, 40) and config.mem_limit == 1536
    assert config.priority == 1 and config.mps == "on" and config.launcher == "local"
    assert config.mpiexec_args == ("--bind-to=none", "-x")
    assert config.tag_output and config.timeout == 30.0 and config.grace == 0.0 and config.keep_logs


def test_module_form_runs_python_m():
    """-m MODULE becomes `python -m MODULE args` with this interpreter."""
    config = parse_args(["-m", "pkg.mod", "--flag"], environ={})
    assert config.command == (sys.executable, "-m", "pkg.mod", "--flag")


def test_environment_fallbacks_and_precedence():
    """MPSRUN_<NAME> variables set options; the command line wins over them."""
    env = {"MPSRUN_NP": "3", "MPSRUN_THREAD_PERCENTAGE": "auto", "MPSRUN_TAG_OUTPUT": "yes",
           "MPSRUN_MPIEXEC_ARG": "--bind-to none", "MPSRUN_MPS": "off", "MPSRUN_TIMEOUT": "9"}
    config = parse_args(["python"], environ=env)
    assert (config.nranks, config.thread_percentage, config.tag_output) == (3, "auto", True)
    assert config.mpiexec_args == ("--bind-to", "none") and config.mps == "off" and config.timeout == 9.0
    config = parse_args(["-np", "5", "--mps", "on", "python"], environ=env)
    assert config.nranks == 5 and config.mps == "on"


@pytest.mark.parametrize(
    ("env", "message"),
    [({"MPSRUN_NP": "zero"}, "MPSRUN_NP"), ({"MPSRUN_TAG_OUTPUT": "maybe"}, "MPSRUN_TAG_OUTPUT must be 1 or 0"),
     ({"MPSRUN_MPS": "sometimes"}, "MPSRUN_MPS must be one of")],
)
def test_bad_environment_values_are_usage_errors(env, message):
    """A malformed MPSRUN_ variable is reported by name."""
    with pytest.raises(ConfigError, match=message):
        parse_args(["python"], environ=env)


BAD_COMMAND_LINES = [
    (["-np", "0", "python"], "must be a whole number from 1"),
    (["-np", "-1", "python"], "must be a whole number from 1"),
    (["-np", "abc", "python"], "must be a whole number from 1"),
    (["-np", "99999999999999999999", "python"], "must be a whole number from 1"),
    (["-np", "2"], "no command given"),
    (["--frobnicate", "python"], "unrecognized arguments: --frobnicate"),
    (["--thread-percentage", "0", "python"], "--thread-percentage: value must be a whole number from 1 to 100"),
    (["--thread-percentage", "101", "python"], "--thread-percentage: value must be a whole number from 1 to 100"),
    (["--thread-percentage", "abc", "python"], "--thread-percentage: value must be a whole number from 1 to 100"),
    (["--mem-limit", "12Q", "python"], "--mem-limit: value must be a size"),
    (["--timeout", "-5", "python"], "must be more than 0 seconds"),
    (["--timeout", "nan", "python"], "must be more than 0 seconds"),
    (["--timeout", "1e9", "python"], "below 1,000,000,000"),  # it said only 'must be a positive number'
    (["--timeout", "\uff15", "python"], "must be more than 0 seconds"),  # a fullwidth 5 was taken as 5
    (["--grace", "1_0", "python"], "must be 0 or more seconds"),  # float() took it as 10
    (["--grace", "-1", "python"], "must be 0 or more seconds"),  # it said "a number of seconds below ..." of -1
    (["--priority", "2", "python"], "--priority: value must be 0"),
    (["--queues", "0", "python"], "--queues: value must be a whole number from 1 to 32"),
    (["--queues", "33", "python"], "--queues: value must be a whole number from 1 to 32"),
    (["--queues", "many", "python"], "--queues: value must be a whole number from 1 to 32"),
    (["--gpus", "zero", "python"], "GPU indices or GPU- UUIDs"),
    (["--gpus", "0,,1", "python"], "comma-separated"),
    (["--gpus", "GPU-", "python"], "GPU indices or GPU- UUIDs"),
    (["--hosts", ",,,", "python"], "must name at least one host"),
    (["--map-by", "socket", "python"], "invalid choice"),
    (["--mps", "maybe", "python"], "invalid choice"),
    (["-v", "-q", "python"], "cannot be used together"),
    (["--hostfile", "/nonexistent", "python"], "cannot read host file '/nonexistent'"),
    (["--hostfile", "/dev/null", "python"], "is not a regular file"),  # a device, as /dev/zero, which never ends
    (["--hostfile", "/", "python"], "is a directory"),
    (["--launcher", "local", "--mpiexec", "/nonexistent", "python"], "is not an executable"),
    (["-np"], "expected one argument"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_COMMAND_LINES)
def test_bad_command_lines_exit_2_with_one_line(argv, message, capsys, no_gpu):
    """Each bad command line gives exit 2 and exactly one line on stderr naming the problem."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpsrun: error: ") and message in err
    assert list(no_gpu.iterdir()) == [no_gpu / "bin"]  # nothing was created


@pytest.mark.parametrize("value", ["0", "-1", "33", "many", "1e1", "0x8", "\uff18", ""])
def test_a_bad_queue_count_says_the_range_once_in_either_spelling(value, capsys, no_gpu, monkeypatch):
    """--queues 33 (or 0, a fullwidth 8, ...) and MPSRUN_QUEUES=33 are refused in one line that says the range
    --queues takes and the value as given, as --thread-percentage does; 33 said 'argument --queues: value: CUDA takes
    1 to 32 hardware queues, not 33' (a stray 'value:'), and 0 'a positive whole number' without the range."""
    expected = f"value must be a whole number from 1 to 32 (CUDA's hardware queues) or auto, not {value!r}"
    assert main(["--queues", value, "--dry-run", "python"]) == 2
    assert capsys.readouterr().err == f"mpsrun: error: argument --queues: {expected} (see mpsrun --help)\n"
    monkeypatch.setenv("MPSRUN_QUEUES", value)
    assert main(["--dry-run", "python"]) == 2
    assert capsys.readouterr().err == f"mpsrun: error: MPSRUN_QUEUES: {expected} (see mpsrun --help)\n"


def test_help_and_version(capsys):
    """--help shows the worked examples and the exit codes; --version the version; no args is a usage error."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "mpsrun -np 4 python sim.py" in out and "exit status" in out and "124" in out
    assert "%%" not in out and "25% of the SMs" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mpsrun ")
    assert main([]) == 2


_WORDS = st.sampled_from(["-np", "-n", "--gpus", "--map-by", "--thread-percentage", "--mem-limit", "--priority",
                          "--mps", "--launcher", "--timeout", "--grace", "--tag-output", "--keep-logs", "-v", "-q",
                          "-m", "--", "python", "x.py", "0", "4", "-1", "auto", "12Q", "all", "on", "block"])


@given(st.lists(st.one_of(_WORDS, st.text(max_size=12)), max_size=10))
def test_parser_only_ever_gives_a_config_or_a_usage_error(argv):
    """Whatever the command line, parsing gives a JobConfig or a ConfigError (exit 2), never a crash."""
    try:
        config = parse_args(argv, environ={})
    except ConfigError:
        return
    except SystemExit as exc:  # -h/--help or --version somewhere in the options
        assert exc.code == 0
        return
    assert config.command and config.ranks >= 1


@given(st.lists(st.one_of(_WORDS, st.text(max_size=12)), max_size=10))
def test_split_leaves_the_command_untouched(argv):
    """The command is the unchanged tail of the command line; options come only from before it."""
    options, command = split_argv(argv)
    assert argv[len(argv) - len(command):] == command
    assert len(options) <= len(argv) - len(command)


def test_mpiexec_command_per_flavour():
    """Open MPI as root gets --allow-run-as-root, --oversubscribe (unless a host file's slots decide), -x per
    exported variable; Hydra needs none of them."""
    from mpsrun.job.mpiexec import mpiexec_command

    argv = mpiexec_command("mpiexec", "openmpi", 8, ["prog"], ["-x", "A"], as_root=True, export=["B"])
    assert argv == ["mpiexec", "-n", "8", "--allow-run-as-root", "--oversubscribe", "-x", "B", "-x", "A", "prog"]
    assert "--oversubscribe" not in mpiexec_command("mpiexec", "openmpi", 2, ["prog"], oversubscribe=False)
    assert mpiexec_command("mpiexec", "mpich", 2, ["prog"], as_root=True, export=["B"]) == [
        "mpiexec", "-n", "2", "prog"]


def test_every_option_is_declared_once_with_its_variable():
    """Each option's MPSRUN_ variable comes from its last spelling, and the parser knows every declared flag."""
    declared = options()
    assert declared["nranks"].variable == "MPSRUN_NP" and declared["mpiexec_args"].variable == "MPSRUN_MPIEXEC_ARG"
    flags = {flag for action in build_parser()._actions for flag in action.option_strings}
    assert all(set(spec.flags) <= flags for spec in declared.values())


def test_a_job_configuration_round_trips_through_json():
    """What node keepers and per-node ranks are handed (JobConfig as JSON) is the same configuration again, tuples,
    auto values and all; its settings (what every per-node rank must share) leave out the launcher's own options."""
    config = parse_args(["-np", "4", "--gpus", "0,GPU-ab", "--thread-percentage", "10,20,30,40", "--mem-limit", "auto",
                         "--grace", "0", "--tag-output", "--mps", "on", "--launcher", "mpiexec", "-v", "-x", "A=1",
                         "--output-filename", "out", "prog"], environ={})
    assert JobConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    settings = config.settings()
    assert settings["thread_percentage"] == [10, 20, 30, 40] and settings["output_filename"].endswith("out")
    assert "launcher" not in settings and "mpiexec" not in settings and "command" not in settings


def test_command_line_wins_over_a_bad_variable():
    """A malformed MPSRUN_NP does not fail a command line that sets -np (the command line wins)."""
    assert parse_args(["-np", "3", "prog"], environ={"MPSRUN_NP": "abc"}).nranks == 3
    with pytest.raises(ConfigError, match="MPSRUN_MPIEXEC_ARG"):
        parse_args(["prog"], environ={"MPSRUN_MPIEXEC_ARG": "--foo 'bar"})


@pytest.mark.parametrize("flag", ["--grace", "--timeout", "-x", "--gpus", "-np"])
def test_an_option_followed_by_the_end_of_options_lacks_its_value(flag):
    """``mpsrun --grace -- true``: ``--`` ends the options, so --grace has no value (a usage error, exit 2). It was
    taken as the value, which argparse turned into an empty list: the job then failed to encode its ranks' welcome
    and ended in a traceback (found by the suite's property test of any command line)."""
    with pytest.raises(ConfigError, match="expected one argument"):
        parse_args([flag, "--", "true"], {})
