"""Tests of offload_trainer.config: defaults, validation messages, parsing, files and overrides.

Run: python -m pytest tests/offload_trainer/config/test_config.py -q
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Callable

import pytest
import torch

from io_engine.config import DirectMode, IOConfig
from offload_trainer.config import (
    ComputeDtype,
    GroupingConfig,
    LRSchedule,
    OffloadConfig,
    OptimizerConfig,
    OptimizerKind,
    Placement,
    PrecisionConfig,
    PrefetchConfig,
    Tier,
    TierConfig,
    parse_bytes,
)
from offload_trainer.config.loader import _convert

GiB = 1 << 30
MiB = 1 << 20


def busy_config(nvme_dir: str = "/mnt/nvme/swap") -> OffloadConfig:
    """A config that differs from the defaults in every section, for round trips."""
    return OffloadConfig(
        tiers=TierConfig(
            params=Placement(device=0.5, host=0.5),
            grads="host",
            optimizer={"host": 0.25, "nvme": 0.75},
            device_budget_bytes="40GiB",
            host_budget_bytes=64 * GiB,
            nvme_dir=nvme_dir,
        ),
        prefetch=PrefetchConfig(lookahead_groups=3, lookahead_bytes="512MiB"),
        grouping=GroupingConfig(module_classes=["Block", "Head"], max_group_bytes=128 * MiB),
        optimizer=OptimizerConfig(
            kind="sgd",
            lr=3e-4,
            betas=[0.8, 0.95],
            momentum=0.5,
            no_decay_patterns=("bias",),
            grad_clip_norm=1.0,
            schedule="warmup_cosine",
            warmup_steps=10,
            total_steps=1000,
            min_lr_ratio=0.0,
        ),
        precision=PrecisionConfig(compute_dtype="fp16", initial_loss_scale=1024.0, loss_scale_window=50),
        io=IOConfig(num_threads=4, queue_depth=16, block_bytes=2 * MiB, direct=DirectMode.OFF),
        grad_accum_steps=4,
        seed=1234,
    )


# --- defaults and enums -------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = OffloadConfig()
    for placement in (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer):
        assert placement == Placement(device=0.0, host=1.0, nvme=0.0)
        assert placement.tiers() == [Tier.HOST]
    assert cfg.tiers.device_budget_bytes is None and cfg.tiers.host_budget_bytes is None
    assert cfg.tiers.nvme_dir is None
    assert not cfg.tiers.uses(Tier.NVME) and cfg.tiers.uses(Tier.HOST)
    assert cfg.prefetch == PrefetchConfig(lookahead_groups=2, lookahead_bytes=None)
    assert cfg.grouping == GroupingConfig(module_classes=(), max_group_bytes=None)
    opt = cfg.optimizer
    assert opt.kind is OptimizerKind.ADAMW
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.momentum) == (1e-3, (0.9, 0.999), 1e-8, 0.01, 0.9)
    assert opt.no_decay_patterns == () and opt.decay_embeddings
    assert opt.grad_clip_norm is None
    assert opt.schedule is LRSchedule.CONSTANT
    assert (opt.warmup_steps, opt.total_steps, opt.min_lr_ratio) == (0, None, 0.1)
    assert cfg.precision.compute_dtype is ComputeDtype.FP32
    assert (cfg.precision.initial_loss_scale, cfg.precision.loss_scale_window, cfg.precision.min_loss_scale) == (
        65536.0,
        1000,
        1.0,
    )
    assert not cfg.precision.uses_loss_scaling
    assert cfg.io == IOConfig()
    assert (cfg.grad_accum_steps, cfg.seed) == (1, 0)


def test_configs_are_frozen() -> None:
    cfg = OffloadConfig()
    with pytest.raises(AttributeError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.optimizer.lr = 1.0  # type: ignore[misc]


def test_compute_dtype_torch_dtype() -> None:
    assert ComputeDtype.FP32.torch_dtype is torch.float32
    assert ComputeDtype.BF16.torch_dtype is torch.bfloat16
    assert ComputeDtype.FP16.torch_dtype is torch.float16


def test_enum_fields_coerce_from_strings() -> None:
    opt = OptimizerConfig(kind="SGD", schedule="warmup_cosine", total_steps=10)
    assert opt.kind is OptimizerKind.SGD and opt.schedule is LRSchedule.WARMUP_COSINE
    prec = PrecisionConfig(compute_dtype="bf16")
    assert prec.compute_dtype is ComputeDtype.BF16 and prec.compute_dtype.torch_dtype is torch.bfloat16
    assert PrecisionConfig(compute_dtype="fp16").uses_loss_scaling


def test_sections_given_as_mappings() -> None:
    cfg = OffloadConfig(tiers={"params": "nvme", "nvme_dir": "/tmp/x"}, optimizer={"lr": 0.5}, io={"num_threads": 2})
    assert cfg.tiers == TierConfig(params=Placement(host=0.0, nvme=1.0), nvme_dir="/tmp/x")
    assert cfg.optimizer.lr == 0.5
    assert cfg.io == IOConfig(num_threads=2)


def test_tuples_are_coerced_and_paths_become_strings(tmp_path: Path) -> None:
    grouping = GroupingConfig(module_classes=["Block"])
    assert grouping.module_classes == ("Block",)
    assert OptimizerConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)
    assert OptimizerConfig(lr=1).lr == 1.0 and isinstance(OptimizerConfig(lr=1).lr, float)
    assert TierConfig(nvme_dir=tmp_path).nvme_dir == str(tmp_path)


# --- validation messages ------------------------------------------------------------------------

# (what to build, the error type, strings the message must contain: the field and the bad value)
BAD_CONFIGS: list[tuple[str, Callable[[], object], type[Exception], tuple[str, ...]]] = [
    ("placement range", lambda: Placement(host=1.5, nvme=-0.5), ValueError, ("Placement.host", "1.5")),
    ("placement sum", lambda: Placement(host=0.5, nvme=0.3), ValueError, ("host=0.5", "nvme=0.3", "sum")),
    ("placement type", lambda: Placement(host="1"), TypeError, ("Placement.host", "'1'")),
    ("device budget", lambda: TierConfig(device_budget_bytes=0), ValueError, ("tiers.device_budget_bytes", "0")),
    ("host budget", lambda: TierConfig(host_budget_bytes="lots"), ValueError, ("tiers.host_budget_bytes", "'lots'")),
    ("budget type", lambda: TierConfig(host_budget_bytes=[1]), TypeError, ("tiers.host_budget_bytes", "[1]")),
    (
        "nvme_dir missing",
        lambda: TierConfig(grads={"host": 0.5, "nvme": 0.5}),
        ValueError,
        ("tiers.nvme_dir", "None", "tiers.grads", "required"),
    ),
    ("nvme_dir empty", lambda: TierConfig(nvme_dir=" "), ValueError, ("tiers.nvme_dir", "' '")),
    ("params placement", lambda: TierConfig(params="disk"), ValueError, ("tiers.params", "'disk'", "'nvme'")),
    ("lookahead_groups", lambda: PrefetchConfig(lookahead_groups=-1), ValueError, ("prefetch.lookahead_groups", "-1")),
    (
        "lookahead_groups type",
        lambda: PrefetchConfig(lookahead_groups=1.5),
        TypeError,
        ("prefetch.lookahead_groups", "1.5"),
    ),
    ("lookahead_bytes", lambda: PrefetchConfig(lookahead_bytes=0), ValueError, ("prefetch.lookahead_bytes", "0")),
    (
        "optimizer_groups_ahead",
        lambda: PrefetchConfig(optimizer_groups_ahead=-1),
        ValueError,
        ("prefetch.optimizer_groups_ahead", "-1"),
    ),
    (
        "module class",
        lambda: GroupingConfig(module_classes=["my block"]),
        ValueError,
        ("grouping.module_classes", "'my block'"),
    ),
    (
        "module class str",
        lambda: GroupingConfig(module_classes="Block"),
        TypeError,
        ("grouping.module_classes", "'Block'", "['Block']"),
    ),
    ("max_group_bytes", lambda: GroupingConfig(max_group_bytes="0B"), ValueError, ("grouping.max_group_bytes", "0")),
    ("kind", lambda: OptimizerConfig(kind="adam"), ValueError, ("optimizer.kind", "'adam'", "'adamw'", "'sgd'")),
    ("lr", lambda: OptimizerConfig(lr=-0.1), ValueError, ("optimizer.lr", "-0.1")),
    ("lr nan", lambda: OptimizerConfig(lr=math.nan), ValueError, ("optimizer.lr", "nan")),
    ("lr bool", lambda: OptimizerConfig(lr=True), TypeError, ("optimizer.lr", "True")),
    ("betas range", lambda: OptimizerConfig(betas=(0.9, 1.0)), ValueError, ("optimizer.betas", "(0.9, 1.0)")),
    ("betas length", lambda: OptimizerConfig(betas=(0.9,)), ValueError, ("optimizer.betas", "(0.9,)", "2 numbers")),
    ("eps", lambda: OptimizerConfig(eps=-1e-8), ValueError, ("optimizer.eps", "-1e-08")),
    ("weight_decay", lambda: OptimizerConfig(weight_decay=-0.5), ValueError, ("optimizer.weight_decay", "-0.5")),
    ("momentum", lambda: OptimizerConfig(momentum=-0.25), ValueError, ("optimizer.momentum", "-0.25")),
    # A setting the update rule would ignore, silently: refused.
    ("momentum adamw", lambda: OptimizerConfig(momentum=0.0), ValueError, ("optimizer.momentum", "0.0", "AdamW", "kind='sgd'")),
    ("eps sgd", lambda: OptimizerConfig(kind="sgd", eps=1e-6), ValueError, ("optimizer.eps", "1e-06", "SGD", "kind='adamw'")),
    (
        "no_decay",
        lambda: OptimizerConfig(no_decay_patterns=("bias", "")),
        ValueError,
        ("optimizer.no_decay_patterns", "''"),
    ),
    ("clip", lambda: OptimizerConfig(grad_clip_norm=0.0), ValueError, ("optimizer.grad_clip_norm", "0.0")),
    ("warmup", lambda: OptimizerConfig(warmup_steps=-3), ValueError, ("optimizer.warmup_steps", "-3")),
    (
        "warmup constant",
        lambda: OptimizerConfig(warmup_steps=5),
        ValueError,
        ("optimizer.warmup_steps", "5", "warmup_cosine"),
    ),
    ("total_steps", lambda: OptimizerConfig(total_steps=0), ValueError, ("optimizer.total_steps", "0")),
    (
        "total_steps missing",
        lambda: OptimizerConfig(schedule="warmup_cosine"),
        ValueError,
        ("optimizer.total_steps", "None", "warmup_cosine"),
    ),
    (
        "total below warmup",
        lambda: OptimizerConfig(schedule="warmup_cosine", warmup_steps=20, total_steps=20),
        ValueError,
        ("optimizer.total_steps", "20"),
    ),
    ("min_lr_ratio", lambda: OptimizerConfig(min_lr_ratio=1.5), ValueError, ("optimizer.min_lr_ratio", "1.5")),
    (
        "compute_dtype",
        lambda: PrecisionConfig(compute_dtype="fp8"),
        ValueError,
        ("precision.compute_dtype", "'fp8'", "'bf16'"),
    ),
    ("compute_dtype type", lambda: PrecisionConfig(compute_dtype=16), TypeError, ("precision.compute_dtype", "16")),
    (
        "loss scale",
        lambda: PrecisionConfig(initial_loss_scale=0.0),
        ValueError,
        ("precision.initial_loss_scale", "0.0"),
    ),
    ("loss window", lambda: PrecisionConfig(loss_scale_window=0), ValueError, ("precision.loss_scale_window", "0")),
    ("min loss scale", lambda: PrecisionConfig(min_loss_scale=-1.0), ValueError, ("precision.min_loss_scale", "-1.0")),
    (
        "min above initial",
        lambda: PrecisionConfig(initial_loss_scale=8.0, min_loss_scale=16.0),
        ValueError,
        ("precision.min_loss_scale", "16.0", "8.0"),
    ),
    ("grad_accum_steps", lambda: OffloadConfig(grad_accum_steps=0), ValueError, ("grad_accum_steps", "0")),
    ("seed", lambda: OffloadConfig(seed=-1), ValueError, ("seed", "-1")),
    ("seed type", lambda: OffloadConfig(seed="7"), TypeError, ("seed", "'7'")),
    ("section type", lambda: OffloadConfig(optimizer=3), TypeError, ("optimizer", "3", "OptimizerConfig")),
    ("io", lambda: OffloadConfig(io={"num_threads": 0}), ValueError, ("io", "num_threads", "0")),
]


@pytest.mark.parametrize("build,error,needles", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_validation_errors_name_field_and_value(
    build: Callable[[], object], error: type[Exception], needles: tuple[str, ...]
) -> None:
    with pytest.raises(error) as info:
        build()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


def test_nvme_placement_with_nvme_dir_is_accepted() -> None:
    tiers = TierConfig(params="nvme", optimizer={"nvme": 1}, nvme_dir="/mnt/nvme")
    assert tiers.uses(Tier.NVME) and tiers.uses(Tier.HOST) and not tiers.uses(Tier.DEVICE)


# --- Placement.parse ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        ("nvme", (0.0, 0.0, 1.0)),
        (" Host ", (0.0, 1.0, 0.0)),
        ("DEVICE", (1.0, 0.0, 0.0)),
        (Tier.NVME, (0.0, 0.0, 1.0)),
        ({"host": 0.2, "nvme": 0.8}, (0.0, 0.2, 0.8)),
        ({Tier.DEVICE: 1}, (1.0, 0.0, 0.0)),
        ({"device": 0.25, "host": 0.25, "nvme": 0.5}, (0.25, 0.25, 0.5)),
        ("host:0.2,nvme:0.8", (0.0, 0.2, 0.8)),
        ("device=0.5, host=0.5", (0.5, 0.5, 0.0)),
        ('{"host": 0.5, "nvme": 0.5}', (0.0, 0.5, 0.5)),
        ({"host": 1 / 3, "nvme": 2 / 3}, (0.0, 1 / 3, 2 / 3)),
    ],
)
def test_placement_parse(value: object, expected: tuple[float, float, float]) -> None:
    placement = Placement.parse(value)
    assert (placement.device, placement.host, placement.nvme) == pytest.approx(expected)
    assert placement.fraction(Tier.DEVICE) == placement.device
    assert placement.tiers() == [t for t, f in zip(Tier, expected) if f > 0]


def test_placement_parse_passes_a_placement_through() -> None:
    placement = Placement(host=0.5, nvme=0.5)
    assert Placement.parse(placement) is placement
    assert placement.tiers() == [Tier.HOST, Tier.NVME]


@pytest.mark.parametrize(
    "value,error,needles",
    [
        ("disk", ValueError, ("'disk'", "'device'", "'host'", "'nvme'")),
        ({"disk": 1.0}, ValueError, ("'disk'", "'nvme'")),
        ({"host": 0.5}, ValueError, ("0.5", "sum")),
        ({"host": 1.5, "nvme": -0.5}, ValueError, ("1.5",)),
        ({"host": "1"}, TypeError, ("'1'",)),
        ({"host": 0.5, Tier.HOST: 0.5}, ValueError, ("twice",)),
        ("host:lots", ValueError, ("'host:lots'", "host:0.2,nvme:0.8")),
        ("{host: 1}", ValueError, ("'{host: 1}'", "JSON")),
        (3, TypeError, ("3", "tier name")),
        (None, TypeError, ("None",)),
    ],
)
def test_placement_parse_errors(value: object, error: type[Exception], needles: tuple[str, ...]) -> None:
    with pytest.raises(error) as info:
        Placement.parse(value)  # type: ignore[arg-type]
    for needle in needles:
        assert needle in str(info.value)


# --- parse_bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("1_000_000", 1_000_000),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("2 gib", 2 * GiB),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        ("10B", 10),
        ("1e3KB", 10**6),
        ("1TiB", 1 << 40),
        (2e9, 2_000_000_000),
        (" 64 KiB ", 64 * 1024),
    ],
)
def test_parse_bytes(value: object, expected: int) -> None:
    result = parse_bytes(value, "x_bytes")  # type: ignore[arg-type]
    assert result == expected and type(result) is int


@pytest.mark.parametrize(
    "value,error,needle",
    [
        ("2 GB/s", ValueError, "'2 GB/s'"),
        ("2gb/", ValueError, "'2gb/'"),
        ("2iB", ValueError, "'2iB'"),
        ("", ValueError, "''"),
        ("-1GiB", ValueError, "negative"),
        (-5, ValueError, "negative"),
        ("1.5B", ValueError, "whole number"),
        ("0.3KiB", ValueError, "whole number"),
        (0.5, ValueError, "whole number"),
        (math.inf, ValueError, "inf"),
        (True, TypeError, "True"),
        (None, TypeError, "None"),
        ([1], TypeError, "[1]"),
    ],
)
def test_parse_bytes_errors(value: object, error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as info:
        parse_bytes(value, "tiers.host_budget_bytes")  # type: ignore[arg-type]
    assert "tiers.host_budget_bytes" in str(info.value)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "value,expected",
    [("16G", 16 * GiB), ("16g", 16 * GiB), ("16Gi", 16 * GiB), ("16GiB", 16 * GiB), ("16GB", 16 * 10**9), ("1P", 2**50),
     ("1PiB", 2**50), ("1PB", 10**15), ("4K", 4096), ("4 KB", 4000)],
)
def test_one_byte_size_grammar(value: str, expected: int) -> None:
    # One grammar for config fields and command-line flags: a bare K/M/G/T/P is binary (as dd and
    # fio read it), KiB..PiB binary, KB..PB decimal. (Before, config fields refused "2g" while the
    # benchmarks took it as 2 GiB.)
    assert parse_bytes(value, "x_bytes") == expected


def test_byte_fields_take_size_strings() -> None:
    assert TierConfig(device_budget_bytes="1.5GB").device_budget_bytes == 1_500_000_000
    assert PrefetchConfig(lookahead_bytes="64MiB").lookahead_bytes == 64 * MiB
    assert GroupingConfig(max_group_bytes="1KiB").max_group_bytes == 1024
    # io_engine's own _bytes fields take them too when read through from_dict.
    assert OffloadConfig.from_dict({"io": {"block_bytes": "2MiB"}}).io.block_bytes == 2 * MiB


# --- dicts and files ----------------------------------------------------------------------------


def test_to_dict_from_dict_round_trip() -> None:
    for cfg in (OffloadConfig(), busy_config()):
        data = cfg.to_dict()
        assert json.loads(json.dumps(data)) == data  # JSON-serialisable, nothing lost
        assert OffloadConfig.from_dict(data) == cfg
        assert OffloadConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_to_dict_uses_plain_values() -> None:
    data = busy_config().to_dict()
    assert data["optimizer"]["kind"] == "sgd"
    assert data["optimizer"]["betas"] == [0.8, 0.95]
    assert data["grouping"]["module_classes"] == ["Block", "Head"]
    assert data["tiers"]["optimizer"] == {"device": 0.0, "host": 0.25, "nvme": 0.75}
    assert data["tiers"]["device_budget_bytes"] == 40 * GiB
    assert data["precision"]["compute_dtype"] == "fp16"
    assert data["io"]["direct"] == "off"
    assert OffloadConfig().to_dict()["optimizer"]["grad_clip_norm"] is None


def test_from_dict_sparse_keeps_defaults() -> None:
    cfg = OffloadConfig.from_dict({"optimizer": {"lr": 0.25}, "seed": 9})
    assert cfg == OffloadConfig(optimizer=OptimizerConfig(lr=0.25), seed=9)
    assert OffloadConfig.from_dict({}) == OffloadConfig()


def test_from_file_json_round_trip(tmp_path: Path) -> None:
    cfg = busy_config(nvme_dir=str(tmp_path / "swap"))
    path = tmp_path / "run.json"
    path.write_text(cfg.to_json())
    assert OffloadConfig.from_file(path) == cfg
    assert OffloadConfig.from_file(str(path)) == cfg


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_from_file_reads_a_file_that_starts_with_a_byte_order_mark(tmp_path: Path, suffix: str) -> None:
    # Windows editors save UTF-8 with a BOM: tomllib refused it as "Invalid statement (at line 1,
    # column 1)", json as "Unexpected UTF-8 BOM (decode using utf-8-sig)". The corpus reader drops it too.
    cfg = busy_config(nvme_dir=str(tmp_path / "swap"))
    path = tmp_path / f"run{suffix}"
    path.write_text("\ufeff" + (cfg.to_toml() if suffix == ".toml" else cfg.to_json()), encoding="utf-8")
    assert OffloadConfig.from_file(path) == cfg


def test_from_file_names_an_io_setting_as_the_file_writes_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[io]\nqueue_depth = 0\n")
    with pytest.raises(ValueError, match=r"run.toml: io.queue_depth=0 must be at least 1$"):
        OffloadConfig.from_file(path)


def test_from_file_names_the_byte_that_is_not_utf8_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_bytes(b"[optimizer]\n# caf\xe9\nlr = 0.1\n")  # Latin-1
    with pytest.raises(ValueError, match=r"run.toml is not UTF-8 text \(byte b'\\xe9' at offset 17\): save it as UTF-8$"):
        OffloadConfig.from_file(path)


def test_from_file_toml_round_trip(tmp_path: Path) -> None:
    # A directory name with every kind of character a TOML string must escape.
    cfg = busy_config(nvme_dir='/mnt/nvme/"swap"\\ü\t\x7f\x01')
    text = cfg.to_toml()
    assert OffloadConfig.from_dict(tomllib.loads(text)) == cfg
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    assert OffloadConfig.from_file(path) == cfg
    default_path = tmp_path / "default.toml"
    default_path.write_text(OffloadConfig().to_toml())
    assert OffloadConfig.from_file(default_path) == OffloadConfig()


def test_from_file_hand_written_toml(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        """
grad_accum_steps = 4

[tiers]
params = "host"
optimizer = { host = 0.25, nvme = 0.75 }
nvme_dir = "/mnt/nvme/swap"
host_budget_bytes = "64GiB"

[optimizer]
lr = 3e-4
betas = [0.9, 0.95]
schedule = "warmup_cosine"
warmup_steps = 100
total_steps = 10000

[io]
direct = false
"""
    )
    cfg = OffloadConfig.from_file(path)
    assert cfg.grad_accum_steps == 4
    assert cfg.tiers.optimizer == Placement(host=0.25, nvme=0.75)
    assert cfg.tiers.host_budget_bytes == 64 * GiB
    assert cfg.optimizer.schedule is LRSchedule.WARMUP_COSINE and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.io.direct is DirectMode.OFF


def test_from_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match="does not exist") as info:
        OffloadConfig.from_file(missing)
    assert str(missing) in str(info.value)

    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("seed = 1\n[optimizer]\nlr = = 3\n")
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_file(bad_toml)
    assert str(bad_toml) in str(info.value) and "TOML" in str(info.value) and "line 3" in str(info.value)

    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{\n  "seed": 1,\n  "optimizer": {"lr": }\n}\n')
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_file(bad_json)
    assert str(bad_json) in str(info.value) and "JSON" in str(info.value) and "line 3" in str(info.value)

    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        OffloadConfig.from_file(not_object)

    yaml = tmp_path / "run.yaml"
    yaml.write_text("seed: 1\n")
    with pytest.raises(ValueError, match=r"'\.yaml'.*\.toml"):
        OffloadConfig.from_file(yaml)

    typo = tmp_path / "typo.json"
    typo.write_text('{"optimzer": {"lr": 0.1}}')
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_file(typo)
    assert str(typo) in str(info.value) and "did you mean 'optimizer'?" in str(info.value)


# --- unknown keys and wrong types in from_dict --------------------------------------------------


def test_unknown_top_level_key_suggests_closest() -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_dict({"optimzer": {"lr": 0.1}})
    message = str(info.value)
    assert "'optimzer'" in message and "top level" in message
    assert "did you mean 'optimizer'?" in message
    for allowed in ("tiers", "prefetch", "grouping", "optimizer", "precision", "io", "grad_accum_steps", "seed"):
        assert allowed in message


def test_unknown_section_key_suggests_closest() -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_dict({"optimizer": {"weight_decey": 0.1}})
    message = str(info.value)
    assert "'weight_decey'" in message and "[optimizer]" in message
    assert "did you mean 'optimizer.weight_decay'?" in message
    assert "no_decay_patterns" in message  # the allowed keys are listed

    with pytest.raises(ValueError) as info:
        OffloadConfig.from_dict({"io": {"threads": 4}})
    assert "[io]" in str(info.value) and "'io.num_threads'" in str(info.value)


def test_an_offload_train_section_given_to_the_engine_config_says_how_to_read_it(tmp_path: Path) -> None:
    # README's run.toml (with [model], [data], [train]) given to OffloadConfig.from_file, as the API
    # example's comment invites: the message said only "unknown key 'model'"
    path = tmp_path / "run.toml"
    path.write_text('grad_accum_steps = 4\n[model]\npreset = "125m"\n[train]\nsteps = 3\n')
    with pytest.raises(ValueError, match=r"\[model\] is a section of offload-train's run config.*RunConfig.from_file\(path\).engine_config\(\)"):
        OffloadConfig.from_file(path)
    with pytest.raises(ValueError, match=r"\[train\] is a section of offload-train's run config"):
        OffloadConfig().with_overrides({"train.steps": "3"})
    from offload_trainer.app.run_config import RunConfig

    assert RunConfig.from_file(path).engine_config().grad_accum_steps == 4  # the way the message names works


def test_unknown_key_without_a_close_match() -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_dict({"zzzz": 1})
    assert "did you mean" not in str(info.value) and "'zzzz'" in str(info.value)


@pytest.mark.parametrize(
    "data,needles",
    [
        ({"optimizer": {"lr": "fast"}}, ("optimizer.lr", "'fast'", "a number")),
        ({"optimizer": {"betas": 0.9}}, ("optimizer.betas", "0.9", "a list of 2 numbers")),
        ({"optimizer": {"total_steps": 1.5}}, ("optimizer.total_steps", "1.5", "an int")),
        ({"grouping": {"module_classes": [1]}}, ("grouping.module_classes[0]", "1", "a string")),
        ({"tiers": {"nvme_dir": 5}}, ("tiers.nvme_dir", "5", "a string")),
        ({"optimizer": 3}, ("[optimizer]", "3")),
        ({"seed": None}, ("seed", "None", "an int")),
        ({"optimizer": {"kind": 1}}, ("optimizer.kind", "1", "'adamw'")),
    ],
)
def test_from_dict_wrong_types(data: dict, needles: tuple[str, ...]) -> None:
    with pytest.raises(TypeError) as info:
        OffloadConfig.from_dict(data)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


# --- with_overrides -----------------------------------------------------------------------------


def test_with_overrides_converts_strings() -> None:
    base = OffloadConfig()
    cfg = base.with_overrides(
        {
            "optimizer.lr": "0.1",
            "optimizer.betas": "[0.9, 0.95]",
            "optimizer.kind": "sgd",
            "optimizer.grad_clip_norm": "1",
            "optimizer.no_decay_patterns": "bias, ln_",
            "grouping.module_classes": '["Block"]',
            "grouping.max_group_bytes": "256MiB",
            "tiers.params": "nvme",
            "tiers.optimizer": "host:0.5,nvme:0.5",
            "tiers.nvme_dir": "/tmp/x",
            "tiers.host_budget_bytes": "2GiB",
            "prefetch.lookahead_groups": "0",
            "precision.compute_dtype": "bf16",
            "io.direct": "false",
            "io.block_bytes": "2MiB",
            "grad_accum_steps": "8",
            "seed": "7",
        }
    )
    assert cfg.optimizer.lr == 0.1
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.optimizer.kind is OptimizerKind.SGD
    assert cfg.optimizer.grad_clip_norm == 1.0
    assert cfg.optimizer.no_decay_patterns == ("bias", "ln_")
    assert cfg.grouping == GroupingConfig(module_classes=("Block",), max_group_bytes=256 * MiB)
    assert cfg.tiers.params == Placement(host=0.0, nvme=1.0)
    assert cfg.tiers.optimizer == Placement(host=0.5, nvme=0.5)
    assert cfg.tiers.host_budget_bytes == 2 * GiB
    assert cfg.prefetch.lookahead_groups == 0
    assert cfg.precision.compute_dtype is ComputeDtype.BF16
    assert cfg.io.direct is DirectMode.OFF and cfg.io.block_bytes == 2 * MiB
    assert (cfg.grad_accum_steps, cfg.seed) == (8, 7)
    assert base == OffloadConfig()  # the original is untouched


def test_with_overrides_comma_tuple_none_and_typed_values() -> None:
    base = OffloadConfig(optimizer=OptimizerConfig(grad_clip_norm=1.0))
    cfg = base.with_overrides(
        {"optimizer.betas": "0.8,0.9", "optimizer.grad_clip_norm": "none", "optimizer.eps": 1e-6, "seed": 3}
    )
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.optimizer.grad_clip_norm is None
    assert cfg.optimizer.eps == 1e-6 and cfg.seed == 3
    assert base.with_overrides({"grouping.module_classes": ""}).grouping.module_classes == ()
    assert base.with_overrides({"io.direct": "on"}).io.direct is DirectMode.ON


def test_with_overrides_section_mapping_and_combined_fields() -> None:
    cfg = OffloadConfig().with_overrides(
        {"optimizer": {"schedule": "warmup_cosine", "total_steps": "100"}, "optimizer.warmup_steps": "10"}
    )
    assert cfg.optimizer.schedule is LRSchedule.WARMUP_COSINE
    assert (cfg.optimizer.total_steps, cfg.optimizer.warmup_steps) == (100, 10)


def test_bool_text_is_read_as_bool() -> None:
    # No field of this config is a bool yet; the reader is shared, so check it directly.
    assert _convert("true", bool, "x", from_text=True) is True
    assert _convert("Off", bool, "x", from_text=True) is False
    with pytest.raises(TypeError, match="x='true' must be true or false"):
        _convert("true", bool, "x")


@pytest.mark.parametrize(
    "overrides,error,needles",
    [
        ({"optimzer.lr": "0.1"}, ValueError, ("'optimzer'", "did you mean 'optimizer'?")),
        ({"optimizer.lrr": "0.1"}, ValueError, ("'optimizer.lrr'", "[optimizer]", "did you mean 'optimizer.lr'?")),
        ({"sed": "1"}, ValueError, ("'sed'", "did you mean 'seed'?")),
        ({"optimizer.lr.x": "1"}, ValueError, ("'optimizer.lr.x'", "too deep")),
        ({"seed.x": "1"}, ValueError, ("'seed.x'", "too deep")),
        ({"optimizer.lr": "fast"}, ValueError, ("optimizer.lr", "'fast'", "not a number")),
        ({"seed": "1.5"}, ValueError, ("seed", "'1.5'", "not an int")),
        ({"optimizer.betas": "0.9"}, ValueError, ("optimizer.betas", "2 numbers")),
        ({"optimizer.betas": "[0.9, "}, ValueError, ("optimizer.betas", "JSON list")),
        ({"optimizer.lr": "-1"}, ValueError, ("optimizer.lr", "-1")),
        ({"tiers.params": "nvme"}, ValueError, ("tiers.nvme_dir", "required")),
        ({"optimizer.kind": "lion"}, ValueError, ("optimizer.kind", "'lion'")),
        ({"io.direct": "maybe"}, ValueError, ("io.direct='maybe' is not valid",)),
        # io_engine.IOConfig names its fields IOConfig.x: the message names the key as the user writes it.
        ({"io.num_threads": "64"}, ValueError, ("io.queue_depth=32", "num_threads=64")),
        ({"io.queue_depth": "0"}, ValueError, ("io.queue_depth=0 must be at least 1",)),
        ({1: "x"}, TypeError, ("1",)),
    ],
)
def test_with_overrides_errors(overrides: dict, error: type[Exception], needles: tuple[str, ...]) -> None:
    with pytest.raises(error) as info:
        OffloadConfig().with_overrides(overrides)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


# --- the learning-rate schedule and weight decay ------------------------------------------------


def test_lr_at_warmup_cosine() -> None:
    opt = OptimizerConfig(lr=1e-3, schedule="warmup_cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    # By hand: warmup is 1e-3 * (step + 1) / 10; then 1e-4 + 9e-4 * (1 + cos(pi * (step - 10) / 100)) / 2.
    expected = {
        0: 1e-4,
        4: 5e-4,
        9: 1e-3,
        10: 1e-3,  # the start of the cosine: progress 0
        35: 1e-4 + 9e-4 * (1 + 0.7071067811865476) / 2,  # progress 1/4: cos(pi/4)
        60: 5.5e-4,  # progress 1/2: halfway between 1e-3 and 1e-4
        85: 1e-4 + 9e-4 * (1 - 0.7071067811865476) / 2,  # progress 3/4
        110: 1e-4,
        111: 1e-4,
        10_000: 1e-4,
    }
    for step, lr in expected.items():
        assert opt.lr_at(step) == pytest.approx(lr, rel=1e-12), step
    assert opt.lr_at(110) == opt.lr * opt.min_lr_ratio  # exactly the floor at total_steps


def test_lr_at_without_warmup_and_constant() -> None:
    cosine = OptimizerConfig(lr=2.0, schedule="warmup_cosine", total_steps=4, min_lr_ratio=0.0)
    half = math.sqrt(0.5)  # cos(pi/4)
    assert [cosine.lr_at(s) for s in range(6)] == pytest.approx([2.0, 1.0 + half, 1.0, 1.0 - half, 0.0, 0.0])
    constant = OptimizerConfig(lr=0.5)
    assert [constant.lr_at(s) for s in (0, 1, 10**6)] == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="step=-1"):
        constant.lr_at(-1)
    with pytest.raises(TypeError, match="step=1.0"):
        constant.lr_at(1.0)  # type: ignore[arg-type]


def _int_keys() -> list[str]:
    """Every int and byte-size field of offload-train's config, as `section.field`."""
    import dataclasses
    import types

    from offload_trainer.app.run_config import RunConfig
    from offload_trainer.config.loader import _field_types

    def is_int(hint: object) -> bool:
        return hint is int or (isinstance(hint, types.UnionType) and int in hint.__args__)

    keys = []
    for name, hint in _field_types(RunConfig).items():
        if dataclasses.is_dataclass(hint):
            keys += [f"{name}.{f}" for f, h in _field_types(hint).items() if is_int(h)]
        elif is_int(hint):
            keys.append(name)
    return keys


INT_KEYS = _int_keys()


BEYOND_INT64 = ["9223372036854775808", "-9223372036854775809", "1" + "0" * 30]


@pytest.mark.parametrize(
    "key, value",
    [(k, v) for k in INT_KEYS for v in BEYOND_INT64 + (["1e400"] if k.endswith("_bytes") else [])],
)
def test_an_int_beyond_int64_is_refused_for_every_field(key: str, value: str) -> None:
    """No setting takes an int torch cannot hold: past int64 it failed deep in the run
    (grad_accum_steps: an OverflowError in the first backward; io.block_bytes 1e400: in the check
    that prints it). Given as text (a command line) and as a TOML/JSON value alike."""
    from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig

    base = RunConfig.from_dict(DEFAULT_RUN)
    section, _, field = key.rpartition(".")
    as_number = 10**400 if value == "1e400" else int(value)
    for raw in (value, as_number):
        with pytest.raises(ValueError, match=rf"^{key.replace('.', '[.]')}=.*(beyond|more than|negative)"):
            base.with_overrides({key: raw}) if isinstance(raw, str) else RunConfig.from_dict(
                {section: {field: raw}} if section else {field: raw}
            )


def test_the_largest_int64_is_still_a_value() -> None:
    assert parse_bytes(str(2**63 - 1), "x") == 2**63 - 1
    assert OffloadConfig(seed=2**63 - 1).seed == 2**63 - 1
    with pytest.raises(ValueError, match="beyond"):
        OffloadConfig(seed=2**63)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("run.json", "[" * 100_000 + "]" * 100_000, "arrays or objects nested too deeply to read"),
        ("run.json", '{"optimizer": ' * 100_000 + "1" + "}" * 100_000, "arrays or objects nested too deeply to read"),
        ("run.toml", "seed = " + "[" * 100_000 + "]" * 100_000, "nests arrays or tables too deeply"),
        ("run.json", '{"seed": 1' + "0" * 5000 + "}", "a number of 5001 digits where at most 4300 are read at line 1, column 10"),
        ("run.toml", "seed = 1" + "0" * 5000, "is not valid TOML"),
        ("run.json", '{"seed": 1, "seed": 2}', "'seed' is given twice"),
        ("run.json", '{"optimizer": {"lr": 0.1, "lr": 0.2}}', "'lr' is given twice"),
    ],
)
def test_a_config_file_no_parser_should_take_is_refused_naming_it(tmp_path: Path, name: str, text: str, message: str) -> None:
    """RecursionError and int()'s digit limit escaped as tracebacks or lines without the file; a key
    given twice in JSON kept the last value silently (TOML refuses it)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_file(path)
    assert str(info.value).startswith(f"config file {path}") and message in str(info.value), str(info.value)


def test_a_path_with_undecodable_bytes_cannot_go_into_toml_and_the_error_names_its_key() -> None:
    """A path with bytes that are not UTF-8 (os.fsdecode's surrogates) failed in the UTF-8 encoder of the
    file write: one line naming no setting (offload-plan --write-config). JSON keeps it (as an escape)."""
    cfg = OffloadConfig(tiers=TierConfig(params="nvme", nvme_dir="/scratch/sw\udcff"))
    with pytest.raises(ValueError, match=r"^tiers\.nvme_dir='/scratch/sw\\udcff' holds bytes that are not UTF-8"):
        cfg.to_toml()
    assert OffloadConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("value", ["0", "1e-45", "0.0009", "1e20", "1e300"])
def test_a_dist_timeout_torch_cannot_take_is_refused(value: str) -> None:
    """datetime.timedelta(seconds=1e20) raised OverflowError at the rendezvous of every rank; 1e-45 s
    is 0 ms to the process group."""
    from offload_trainer.app.run_config import RunConfig

    with pytest.raises(ValueError, match=r"^train\.dist_timeout_s=.* must be a number of seconds from 0\.001 to 1e\+09"):
        RunConfig().with_overrides({"train.dist_timeout_s": value})
    assert RunConfig().with_overrides({"train.dist_timeout_s": "1e9"}).train.dist_timeout_s == 1e9


@pytest.mark.parametrize(
    "data, overrides, belongs",
    [
        ({"train": {"lr": 0.1}}, {"train.lr": "0.1"}, "it belongs at [optimizer] (optimizer.lr)"),
        ({"lr": 0.1}, {"lr": "0.1"}, "it belongs at [optimizer] (optimizer.lr)"),
        ({"train": {"seed": 1}}, {"train.seed": "1"}, "it belongs at the top level (seed)"),
        ({"optimizer": {"steps": 3}}, {"optimizer.steps": "3"}, "it belongs at [train] (train.steps)"),
        ({"data": {"nvme_dir": "/x"}}, {"data.nvme_dir": "/x"}, "it belongs at [tiers] (tiers.nvme_dir)"),
    ],
)
def test_a_key_in_the_wrong_section_is_told_where_it_belongs(data: dict, overrides: dict, belongs: str) -> None:
    """A key of another section (or of the top level) got a list of this section's keys and, at best,
    a close match there ('train.steps' for lr): now the line names the section it belongs in."""
    from offload_trainer.app.run_config import RunConfig

    for make in (lambda: RunConfig.from_dict(data), lambda: RunConfig().with_overrides(overrides)):
        with pytest.raises(ValueError, match="unknown key") as info:
            make()
        assert belongs in str(info.value), str(info.value)


def test_a_tier_hashes_without_python_code_and_keys_dicts_as_before() -> None:
    """The engine's byte counters are dicts keyed by Tier, added to for every copy and IO request:
    Enum's own __hash__ was a Python call each time."""
    import copy
    import pickle
    import sys

    from offload_trainer.config import Tier

    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        table = {Tier.NVME: 1}
        table[Tier.NVME] = table.get(Tier.NVME, 0) + 1
    finally:
        sys.setprofile(None)
    assert calls == [] and table == {Tier.NVME: 2}
    assert pickle.loads(pickle.dumps(table)) == table and copy.deepcopy(table) == table
    assert Tier("host") is Tier.HOST and {Tier.HOST, Tier.HOST, Tier.NVME} == {Tier.NVME, Tier.HOST}
