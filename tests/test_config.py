"""Tests of the run-config parser and validator (fedspc_app.core.config)."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from fedspc_app.core.config import RunConfig, parse_run_config, validate
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import METHODS

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _kebab(name: str) -> str:
    return name.replace("_", "-")


@pytest.fixture(scope="module")
def defaults() -> dict:
    """The ``[tool.flwr.app.config]`` table of pyproject.toml."""
    with PYPROJECT.open("rb") as file:
        return tomllib.load(file)["tool"]["flwr"]["app"]["config"]


FIELD_NAMES = [f.name for f in dataclasses.fields(RunConfig) if f.name != "extra"]


# ------------------------------------------------------------------ defaults
def test_pyproject_defaults_parse_to_runconfig_defaults(defaults):
    # Prepare / Execute
    parsed = parse_run_config(defaults)

    # Assert: equal field by field (not only via __eq__), and nothing extra
    assert parsed == RunConfig()
    for name in FIELD_NAMES:
        assert getattr(parsed, name) == getattr(RunConfig(), name), name
        assert type(getattr(parsed, name)) is type(getattr(RunConfig(), name)), name
    assert dict(parsed.extra) == {}


def test_pyproject_keys_match_runconfig_fields_both_ways(defaults):
    # Prepare
    field_keys = {_kebab(name) for name in FIELD_NAMES}

    # Execute
    pyproject_keys = set(defaults)

    # Assert
    assert field_keys - pyproject_keys == set(), "fields without a pyproject default"
    assert pyproject_keys - field_keys == set(), "pyproject keys without a field"


def test_runconfig_default_is_valid():
    # The defaults pass every check, read back from their own kebab-case keys they are
    # the same config, and they name a run: a default the parser rejects or changes
    # fails here.
    config = RunConfig()
    assert parse_run_config(config.to_dict()) == config
    assert config.resolved_run_name == "digits-cnn-fedavg-a0.1-s0"


# ------------------------------------------------------------ keys and types
def test_kebab_case_keys_map_to_fields():
    # Prepare
    run_config = {
        "batch-size": 32,
        "learning-rate": 0.05,
        "local-epochs": 2,
        "fraction-train": 0.5,
        "fedspc-upload": "explicit",
        "vit-embed-dim": 192,
        "fedbabu-finetune-parts": "head",
        "method": "fedrep",
        "fedspc": True,
        "data-dir": "/tmp/somewhere",
    }

    # Execute
    config = parse_run_config(run_config)

    # Assert
    assert config.batch_size == 32
    assert config.learning_rate == 0.05
    assert config.local_epochs == 2
    assert config.fraction_train == 0.5
    assert config.fedspc_upload == "explicit"
    assert config.vit_embed_dim == 192
    assert config.fedbabu_finetune_parts == "head"
    assert config.method == "fedrep"
    assert config.fedspc is True
    assert config.data_dir == "/tmp/somewhere"
    # untouched fields keep their defaults
    assert config.num_rounds == RunConfig().num_rounds


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("batch-size", "abc"),
        ("num-rounds", [1, 2]),
        ("num-rounds", True),
        ("fedspc", "maybe"),
        ("download", 2),
        ("learning-rate", "fast"),
        ("alpha", False),
        # a string key given a TOML/YAML array, table or date-time (no str() of it)
        ("shared-keys", ["features.0", "features.3"]),
        ("run-name", {"a": 1}),
        ("stop-by", datetime(2026, 12, 5, 18, 30, tzinfo=timezone(timedelta(hours=1)))),
    ],
)
def test_wrong_type_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_run_config({key: value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("false", False), ("True", True), ("FALSE", False),
     (True, True), (False, False)],
)
def test_bool_accepts_true_false_strings(value, expected):
    config = parse_run_config({"fedspc": value, "method": "fedper"})
    assert config.fedspc is expected


def test_int_accepts_integral_float():
    config = parse_run_config({"batch-size": 3.0, "num-rounds": 4.0})
    assert config.batch_size == 3 and type(config.batch_size) is int
    assert config.num_rounds == 4 and type(config.num_rounds) is int


def test_int_accepts_numeric_string():
    assert parse_run_config({"batch-size": "16"}).batch_size == 16


@pytest.mark.parametrize("key", ["batch-size", "local-epochs", "num-rounds"])
def test_int_rejects_non_integral_float(key):
    # 3.5 must not be silently truncated to 3
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_run_config({key: 3.5})


def test_float_accepts_int_and_string():
    config = parse_run_config({"learning-rate": 1, "alpha": "0.5"})
    assert config.learning_rate == 1.0 and type(config.learning_rate) is float
    assert config.alpha == 0.5


# ------------------------------------------------------------- unknown keys
@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("local-epoch", "local-epochs"), ("learning_rate", "learning-rate")],
)
def test_unknown_key_near_miss_gets_a_hint(key, suggestion):
    with pytest.raises(ConfigError) as info:
        parse_run_config({key: 1})
    message = str(info.value)
    assert f"'{key}'" in message
    assert "did you mean" in message
    assert suggestion in message


def test_unknown_key_without_near_miss_is_still_an_error():
    with pytest.raises(ConfigError, match="unknown run-config key 'zzz'"):
        parse_run_config({"zzz": 1})


def test_extra_key_is_not_a_field():
    with pytest.raises(ConfigError, match="'extra'"):
        parse_run_config({"extra": {}})


def test_x_keys_are_kept_in_extra():
    # Execute
    config = parse_run_config({"x-note": "hello", "x-level": 3, "seed": 7})

    # Assert
    assert dict(config.extra) == {"x-note": "hello", "x-level": 3}
    assert config.seed == 7
    assert config.to_dict()["x-note"] == "hello"


# ------------------------------------------------------------------ choices
CHOICES = {
    "dataset": ["digits", "cifar10", "cifar100", "tinyimagenet"],
    "model": ["cnn", "cnn-bn", "resnet18", "resnet34", "vgg11", "vit"],
    "method": list(METHODS),
    "aggregation": ["mean", "weighted"],
    "augment": ["auto", "none", "crop-flip"],
    "device": ["auto", "cpu", "cuda"],
    "precision": ["auto", "fp32", "bf16"],
    "fedspc-upload": ["derived", "explicit"],
    "fedbabu-finetune-parts": ["all", "head"],
    "partition": ["dirichlet", "classes"],
}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_choice_rejects_unknown_value_listing_valid_ones(key):
    with pytest.raises(ConfigError) as info:
        parse_run_config({key: "bogus-value"})
    message = str(info.value)
    assert f"'{key}'" in message
    assert "bogus-value" in message
    for choice in CHOICES[key]:
        assert choice in message


@pytest.mark.parametrize(
    ("key", "value"), [(key, value) for key, values in CHOICES.items() for value in values]
)
def test_choice_accepts_every_valid_value(key, value):
    config = parse_run_config({key: value})
    assert getattr(config, key.replace("-", "_")) == value


@pytest.mark.parametrize("method", list(METHODS))
def test_methods_registry_is_what_validation_accepts(method):
    # Every registered method is accepted on its own ...
    config = parse_run_config({"method": method})
    assert (config.method, config.fedspc, config.label) == (method, False, method)
    # ... and with FedSPC unless it already corrects everything (SCAFFOLD).
    if METHODS[method].control_variates:
        with pytest.raises(ConfigError, match="set fedspc = false"):
            parse_run_config({"method": method, "fedspc": True})
    elif METHODS[method].shared == "none":
        with pytest.raises(ConfigError, match="shares nothing with the server"):
            parse_run_config({"method": method, "fedspc": True})
    else:
        config = parse_run_config({"method": method, "fedspc": True})
        assert (config.method, config.fedspc, config.label) == (method, True,
                                                                f"{method}+fedspc")


def test_the_papers_methods_are_registered_and_nothing_else_validates():
    # The eight methods the README and the paper compare.
    assert {"fedavg", "fedprox", "scaffold", "fedper", "fedrep", "fedbabu",
            "lgfedavg", "ditto"} <= set(METHODS)
    assert [name for name, spec in METHODS.items() if spec.control_variates] == ["scaffold"]
    for name in ("fedspc", "FedAvg", "fedavg+fedspc", "pfedme", ""):
        assert name not in METHODS
        with pytest.raises(ConfigError, match="'method'"):
            parse_run_config({"method": name})
        with pytest.raises(ConfigError, match="'method'"):
            parse_run_config({"method": name, "fedspc": True})


# ------------------------------------------------------------------- ranges
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("alpha", 0.0),
        ("alpha", -0.1),
        ("alpha", math.nan),
        ("alpha", math.inf),
        ("num-rounds", 0),
        ("local-epochs", 0),
        ("learning-rate", 0.0),
        ("learning-rate", -0.01),
        ("learning-rate", math.nan),
        ("fraction-train", 0.0),
        ("fraction-train", 1.5),
        ("fraction-train", math.nan),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("batch-size", 0),
        ("num-clients", -1),
        ("min-samples", 0),
        ("weight-decay", -1.0),
        ("ditto-personal-epochs", 0),
        ("vit-embed-dim", 100),
        ("vit-embed-dim", 0),
        ("run-name", "a/b"),
        ("run-name", ".."),
        ("output-dir", ""),
        ("output-dir", "~nosuchuser-fedspc/results"),
        ("data-dir", "~nosuchuser-fedspc"),
        ("client-state-dir", "~nosuchuser-fedspc/state"),
    ],
)
def test_out_of_range_values_are_rejected(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_run_config({key: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("fraction-train", 1.0),
        ("fraction-train", 0.01),
        ("momentum", 0.99),
        ("vit-embed-dim", 192),
        ("local-epochs", 1),
        ("num-clients", 0),
        ("fedrep-head-epochs", 0),
        ("run-name", "my-run_1"),
    ],
)
def test_boundary_values_are_accepted(key, value):
    config = parse_run_config({key: value})
    assert getattr(config, key.replace("-", "_")) == value


def test_validate_checks_a_directly_built_config():
    with pytest.raises(ConfigError, match="'learning-rate'"):
        validate(RunConfig(learning_rate=0.0))


# ------------------------------------------------------------------- fedspc
def test_scaffold_with_fedspc_is_rejected():
    with pytest.raises(ConfigError, match="scaffold"):
        parse_run_config({"method": "scaffold", "fedspc": True})


@pytest.mark.parametrize("fedspc", [False, "false", 0])
def test_scaffold_without_fedspc_is_fine(fedspc):
    config = parse_run_config({"method": "scaffold", "fedspc": fedspc, "seed": 2})
    assert config.fedspc is False
    assert config.resolved_run_name == "digits-cnn-scaffold-a0.1-s2"
    # fedspc alone stood in the way: the same config with it is refused.
    with pytest.raises(ConfigError, match="method 'scaffold' already corrects"):
        validate(config.replace(fedspc=True))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"method": "fedrep", "fedspc": True}, r"with FedSPC \(fedspc = true\)"),
    ({"method": "fedavg", "fedspc": True}, r"with FedSPC \(fedspc = true\)"),
    ({"method": "scaffold"}, "with method 'scaffold' \\(its control variates\\)"),
])
def test_momentum_with_control_variates_is_refused(overrides, message):
    """Algorithm 1's u_k update assumes plain SGD steps: with momentum u_k diverges."""
    with pytest.raises(ConfigError, match=message) as error:
        parse_run_config({**overrides, "momentum": 0.9})
    assert "set momentum = 0" in str(error.value)
    assert parse_run_config(overrides).momentum == 0.0
    # momentum stays open to the methods without control variates.
    assert parse_run_config({"method": overrides["method"].replace("scaffold", "fedavg"),
                             "momentum": 0.9}).momentum == 0.9


@pytest.mark.parametrize("method", sorted(m for m in METHODS
                                          if m not in ("scaffold", "local")))
def test_every_other_method_accepts_fedspc(method):
    config = parse_run_config({"method": method, "fedspc": "true"})
    assert config.fedspc is True
    assert config.method == method


# ------------------------------------------------------------------ helpers
def test_label():
    assert parse_run_config({"method": "fedrep", "fedspc": True}).label == "fedrep+fedspc"
    assert parse_run_config({"method": "fedrep"}).label == "fedrep"


def test_resolved_run_name_is_built_from_settings():
    config = parse_run_config({
        "dataset": "cifar10", "model": "resnet34", "method": "fedper", "fedspc": True,
        "alpha": 0.5, "seed": 3,
    })
    assert config.resolved_run_name == "cifar10-resnet34-fedper+fedspc-a0.5-s3"


def test_resolved_run_name_prefers_run_name():
    assert parse_run_config({"run-name": "mine"}).resolved_run_name == "mine"


def test_run_dir_is_absolute(tmp_path, monkeypatch):
    # Prepare: a relative output-dir, resolved against the working directory
    monkeypatch.chdir(tmp_path)

    # Execute
    config = parse_run_config({"output-dir": "out", "run-name": "r1"})

    # Assert
    assert config.run_dir.is_absolute()
    assert config.run_dir == (tmp_path / "out" / "r1").resolve()


# ----------------------------------------------------------------- data dir
def test_empty_data_dir_follows_fedspc_cache_dir(tmp_path, monkeypatch):
    # Prepare
    from fedspc_app.data import datasets

    monkeypatch.setenv("FEDSPC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    # Execute
    resolved = parse_run_config({"data-dir": ""}).resolved_data_dir

    # Assert: $FEDSPC_CACHE_DIR/data, the same folder the dataset loader uses
    assert resolved == (tmp_path / "cache" / "data").resolve()
    assert resolved == datasets.default_data_dir().resolve()


def test_empty_data_dir_without_cache_env_is_under_home(tmp_path, monkeypatch):
    # Prepare
    from fedspc_app.data import datasets

    monkeypatch.delenv("FEDSPC_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    # Execute
    resolved = RunConfig(data_dir="").resolved_data_dir

    # Assert
    assert resolved == (tmp_path / "home" / ".cache" / "fedspc" / "data").resolve()
    assert resolved == datasets.default_data_dir().resolve()


def test_explicit_data_dir_wins_over_the_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSPC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert parse_run_config({"data-dir": "mine"}).resolved_data_dir == (tmp_path / "mine")
    assert RunConfig(data_dir="~/d").resolved_data_dir == Path("~/d").expanduser().resolve()


def test_to_dict_round_trips(tmp_path):
    # Prepare
    config = parse_run_config({
        "method": "ditto", "fedspc": True, "fedspc-upload": "explicit", "alpha": 0.3,
        "batch-size": 16, "output-dir": str(tmp_path), "x-tag": "t",
    })

    # Execute
    as_dict = config.to_dict()
    again = parse_run_config(as_dict)

    # Assert
    assert set(as_dict) == {_kebab(n) for n in FIELD_NAMES} | {"x-tag"}
    assert again == config
    assert dict(again.extra) == {"x-tag": "t"}
    assert again.to_dict() == as_dict


def test_default_to_dict_matches_pyproject(defaults):
    assert RunConfig().to_dict() == defaults


@pytest.mark.parametrize("key,value,message", [
    ("evaluate-every", 0, "'evaluate-every' must be >= 1"),
    ("evaluate-fraction", 0.0, "'evaluate-fraction' must be in (0, 1]"),
    ("evaluate-fraction", 1.5, "'evaluate-fraction' must be in (0, 1]"),
    ("min-train-replies", 0.0, "'min-train-replies' must be in (0, 1]"),
    ("max-failed-rounds", 0, "'max-failed-rounds' must be >= 1"),
    ("round-timeout", 0.0, "'round-timeout' must be > 0"),
])
def test_schedule_and_failure_policy_keys_are_range_checked(key, value, message):
    with pytest.raises(ConfigError) as info:
        parse_run_config({key: value})
    assert message in str(info.value)


@pytest.mark.parametrize("key", ["resume", "keep-client-state"])
def test_resume_and_kept_client_state_need_checkpoints(key):
    with pytest.raises(ConfigError, match=f"'{key} = true' needs 'checkpoint = true'"):
        parse_run_config({key: True, "checkpoint": False})
