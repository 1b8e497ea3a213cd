"""IOConfig and DirectMode: defaults, parsing, and a clear error for every bad value."""

from __future__ import annotations

import dataclasses

import pytest

from io_engine import DirectMode, IOConfig


def test_defaults_are_valid():
    config = IOConfig()
    assert (config.num_threads, config.queue_depth, config.block_bytes, config.alignment_bytes) == (
        None,  # one worker per usable CPU, 2 to 8: test_usable_cpus.py
        32,
        1 << 20,
        4096,
    )
    assert config.direct is DirectMode.AUTO
    assert config.verify_checksums is True


@pytest.mark.parametrize("value", [1, 0, "false", None])
def test_verify_checksums_must_be_a_bool(value):
    with pytest.raises(TypeError) as info:
        IOConfig(verify_checksums=value)
    assert f"IOConfig.verify_checksums={value!r} must be True or False" in str(info.value)
    assert IOConfig(verify_checksums=False).verify_checksums is False


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        IOConfig().num_threads = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "value, mode",
    [
        ("on", DirectMode.ON),
        ("OFF", DirectMode.OFF),
        (" Auto ", DirectMode.AUTO),
        (True, DirectMode.ON),
        (False, DirectMode.OFF),
        (DirectMode.OFF, DirectMode.OFF),
    ],
)
def test_direct_mode_parsing(value, mode):
    assert DirectMode.parse(value) is mode
    assert IOConfig(direct=value).direct is mode


@pytest.mark.parametrize("value", ["yes", "", 1, None, 0.0])
def test_bad_direct_mode(value):
    with pytest.raises(ValueError) as info:
        IOConfig(direct=value)
    message = str(info.value)
    assert f"IOConfig.direct={value!r}" in message
    assert "'on', 'off', 'auto'" in message


@pytest.mark.parametrize("field", ["num_threads", "queue_depth", "block_bytes", "alignment_bytes"])
@pytest.mark.parametrize("value", ["8", 8.0, True, None])
def test_non_int_fields_are_type_errors(field, value):
    if field == "num_threads" and value is None:
        assert IOConfig(num_threads=None).num_threads is None  # unset: one per usable CPU
        return
    with pytest.raises(TypeError) as info:
        IOConfig(**{field: value})
    assert f"IOConfig.{field}={value!r}" in str(info.value)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"num_threads": 0}, "IOConfig.num_threads=0 must be at least 1"),
        ({"queue_depth": -1}, "IOConfig.queue_depth=-1 must be at least 1"),
        ({"block_bytes": 0}, "IOConfig.block_bytes=0 must be at least 1"),
        ({"alignment_bytes": 0}, "IOConfig.alignment_bytes=0 must be at least 1"),
        ({"alignment_bytes": 3000}, "IOConfig.alignment_bytes=3000 must be a power of two >= 512"),
        ({"alignment_bytes": 256, "block_bytes": 4096}, "IOConfig.alignment_bytes=256 must be a power of two"),
        ({"block_bytes": 5000}, "IOConfig.block_bytes=5000 must be a multiple of alignment_bytes=4096"),
        ({"block_bytes": 4095}, "IOConfig.block_bytes=4095 must be a multiple of alignment_bytes=4096"),
        ({"num_threads": 16, "queue_depth": 8}, "IOConfig.queue_depth=8 is below num_threads=16"),
    ],
)
def test_bad_values_name_field_and_value(fields, expected):
    with pytest.raises(ValueError) as info:
        IOConfig(**fields)
    assert expected in str(info.value)


def test_block_bytes_error_suggests_a_valid_value():
    with pytest.raises(ValueError, match="for example 8192"):
        IOConfig(block_bytes=3 * 4096 - 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"alignment_bytes": 512, "block_bytes": 512 * 3},
        {"num_threads": 1, "queue_depth": 1, "block_bytes": 4096},
        {"alignment_bytes": 8192, "block_bytes": 8192},
    ],
)
def test_edge_values_are_accepted(fields):
    config = IOConfig(**fields)
    assert all(getattr(config, k) == v for k, v in fields.items())
