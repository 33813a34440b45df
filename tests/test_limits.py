"""Unit tests: validation of thread percentages, memory limits, priorities and MPS modes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsrun.config.values import (
    AUTO,
    MPS_MODES,
    mib_text,
    parse_choice,
    parse_mem_limit,
    parse_priority,
    parse_thread_percentage,
    parse_thread_spec,
)
from mpsrun.errors import ConfigError
from mpsrun.rank.frameworks import queue_overflow


@pytest.mark.parametrize(("value", "expected"), [(1, 1), (100, 100), ("25", 25), (" 50 ", 50)])
def test_thread_percentage_accepts_whole_numbers_1_to_100(value, expected):
    """Integers (or integer strings) from 1 to 100 are accepted as ints."""
    assert parse_thread_percentage(value) == expected


@pytest.mark.parametrize("value", [0, 101, -5, "abc", "", 12.5, 50.0, None, True, "1e2", "\u0663", "+5"])
def test_thread_percentage_rejects_everything_else(value):
    """Out-of-range, fractional, float, boolean, non-ASCII and non-numeric values raise ConfigError naming the setting."""
    with pytest.raises(ConfigError, match="thread_percentage must be a whole number from 1 to 100") as info:
        parse_thread_percentage(value)
    assert isinstance(info.value, ValueError)
    assert info.value.setting == "thread_percentage"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4G", 4096), ("4g", 4096), ("4GiB", 4096), ("512M", 512), ("1.5G", 1536), (2 << 30, 2048),
     ("1T", 1 << 20), ("2048K", 2)],
)
def test_mem_limit_is_a_number_of_mib(value, expected):
    """Sizes become whole MiB, which MPS takes (as M, or G when whole gigabytes: mib_text)."""
    assert parse_mem_limit(value) == expected


@pytest.mark.parametrize(("mib", "text"), [(4096, "4G"), (1536, "1536M"), (1, "1M"), (1 << 20, "1024G")])
def test_a_limit_is_spelled_as_mps_takes_it(mib, text):
    """Whole gigabytes as G, else megabytes: the units MPS accepts, read back by parse_mem_limit as given."""
    assert mib_text(mib) == text and parse_mem_limit(text) == mib


@pytest.mark.parametrize("value", ["12Q", "", "G", "-1G", "0M", "100", "1.5", None, True, 3.5, "4 G B",
                                   "99999999999999999999999T"])
def test_mem_limit_rejects_malformed_sizes(value):
    """Unknown units, missing numbers, sizes under 1M and non-strings raise ConfigError."""
    with pytest.raises(ConfigError, match="mem_limit"):
        parse_mem_limit(value)


@given(st.integers(min_value=1, max_value=1 << 20), st.sampled_from(["M", "G", "m", "g", "MiB", "GB"]))
def test_mem_limit_round_trips_whole_sizes(number, unit):
    """Any whole size in M or G parses to its number of MiB, and its text parses back to the same."""
    mib = number * (1024 if unit[0] in "Gg" else 1)
    assert parse_mem_limit(f"{number}{unit}") == mib and parse_mem_limit(mib_text(mib)) == mib


@given(st.text())
def test_mem_limit_never_crashes(text):
    """Arbitrary text either parses to a valid MPS size (or ``auto``, in any case) or raises ConfigError; nothing
    else."""
    try:
        result = parse_mem_limit(text)
    except ConfigError:
        return
    if text.strip().lower() == "auto":
        assert result is AUTO
        return
    assert isinstance(result, int) and 1 <= result <= 1 << 30


@given(st.one_of(st.integers(), st.text(), st.floats(allow_nan=True)))
def test_thread_percentage_property(value):
    """Whatever the input, the result is an int in 1..100 or a ConfigError."""
    try:
        result = parse_thread_percentage(value)
    except ConfigError:
        return
    assert isinstance(result, int) and 1 <= result <= 100


def test_priority_and_mode():
    """Priority takes 0 or 1; mps mode takes auto/on/off case-insensitively; others raise ConfigError."""
    assert parse_priority("1") == 1 and parse_priority(0) == 0
    assert parse_choice("ON", MPS_MODES, "mps") == "on"
    for bad in (2, "high", True):
        with pytest.raises(ConfigError, match="priority"):
            parse_priority(bad)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="mps must be one of"):
            parse_choice(bad, MPS_MODES, "mps")


def test_thread_spec_text_and_values():
    """--thread-percentage: auto, one value, or one per rank (text or Python values), validated once into a type."""
    assert parse_thread_spec("AUTO") == "auto" and parse_thread_spec("25") == 25
    assert parse_thread_spec("10, 20") == (10, 20) and parse_thread_spec([10, 20]) == (10, 20)
    assert parse_thread_spec(None) is None
    for bad in ("10,x", "10,,20", [], "0"):
        with pytest.raises(ConfigError):
            parse_thread_spec(bad)


@pytest.mark.parametrize(("asked", "clients", "said"), [("8", 16, True), ("8", 15, False), ("16", 8, True),
                                                         ("3", 42, False), (None, 48, False), ("many", 16, False),
                                                         ("8", None, False)])
def test_an_overflow_of_a_gpus_hardware_queues_is_found(asked, clients, said):
    """Clients x CUDA_DEVICE_MAX_CONNECTIONS beyond the GPU's 126 queues explain a failed rank (16 x 8, 8 x 16); within
    them (15 x 8, 42 x 3), unset, unreadable, or with the clients unknown (--gpu-bind none), nothing is said."""
    env = {} if asked is None else {"CUDA_DEVICE_MAX_CONNECTIONS": asked}
    found = queue_overflow(env, clients, 126)
    assert bool(found) is said
    if said:
        assert f"{int(asked) * clients} in all" in found and f"--queues {126 // clients} or fewer" in found
