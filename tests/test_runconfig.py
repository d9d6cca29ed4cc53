"""Run-configs as users give them on command lines (fedspc_app.launch.runconfig)."""

from __future__ import annotations

import pytest

from fedspc_app.core.errors import ConfigError
from fedspc_app.launch.runconfig import (
    check_resources,
    load_overrides,
    parse_assignments,
    resolve_run_config,
)


def test_assignments_are_toml_scalars():
    text = "num-rounds=3 fedspc=true learning-rate=1e-3 method='fedrep' run-name=\"a b\" data-dir=''"
    assert parse_assignments(text) == {
        "num-rounds": 3, "fedspc": True, "learning-rate": 0.001, "method": "fedrep",
        "run-name": "a b", "data-dir": "",
    }
    assert parse_assignments("   ") == {}


@pytest.mark.parametrize("text", [
    "num-rounds",             # no value: flwr's own parser drops it silently
    "num-rounds=3 fedspc",    # one good pair, one word
    "num-rounds=",            # empty value
    "method='fedrep",         # unterminated quote
    "method=fedrep",          # a bare word is not a TOML value
    "alpha=[0.1, 1.0]",       # not a scalar
])
def test_a_bad_assignment_is_one_config_error_naming_it(text):
    with pytest.raises(ConfigError, match="key=value|value must be"):
        parse_assignments(text)


def test_preset_then_assignments(tmp_path):
    preset = tmp_path / "preset.toml"
    preset.write_text('method = "fedper"\nnum-rounds = 100\nalpha = 0.1\n')
    assert load_overrides(preset, "num-rounds=2 fedspc=true") == {
        "method": "fedper", "num-rounds": 2, "alpha": 0.1, "fedspc": True}
    assert load_overrides(None, "seed=4") == {"seed": 4}


def test_a_missing_or_malformed_preset_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_overrides(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("method = \n")
    with pytest.raises(ConfigError, match="cannot read run-config file"):
        load_overrides(broken)


@pytest.mark.parametrize("line,key", [
    ("stop-by = 2026-12-05T18:30:00+01:00", "stop-by"),  # a TOML date-time, unquoted
    ('shared-keys = ["features.0", "features.3"]', "shared-keys"),
    ("x-note = {a = 1}", "x-note"),
])
def test_a_preset_value_flower_cannot_carry_is_one_config_error(tmp_path, line, key):
    preset = tmp_path / "preset.toml"
    preset.write_text(f"num-rounds = 2\n{line}\n")
    with pytest.raises(ConfigError, match=f"preset.toml: '{key}' must be a TOML number, "
                                          "true/false or a quoted string"):
        load_overrides(preset)
    preset.write_text('stop-by = "2026-12-05T18:30:00+01:00"\nrun-name = 7\n')
    assert load_overrides(preset) == {"stop-by": "2026-12-05T18:30:00+01:00", "run-name": 7}


@pytest.mark.parametrize("clients,cpus,gpus,problem", [
    (0, 1.0, 0.0, "clients must be >= 1"),
    (10, 0.0, 0.0, "client-cpus must be > 0"),
    (10, float("nan"), 0.0, "client-cpus must be > 0"),
    (10, 1.0, -0.25, "client-gpus must be >= 0"),
])
def test_simulation_resources_are_range_checked(clients, cpus, gpus, problem):
    with pytest.raises(ConfigError, match=problem):
        check_resources(clients, cpus, gpus)
    check_resources(1, 0.5, 0.25)  # fractional resources are fine


def test_an_undeclared_x_key_is_refused_before_a_superlink_sees_it(tmp_path):
    # A SuperLink refuses run-config keys the app does not declare; the launcher says
    # so first, naming the key and where to declare it. Declared, it is kept.
    (tmp_path / "pyproject.toml").write_text(
        '[tool.flwr.app.config]\nseed = 0\n"x-level" = 1\n')
    with pytest.raises(ConfigError, match=r"x-note .*not declared.*x-note = "):
        resolve_run_config({"x-note": "a", "x-level": 2}, tmp_path)
    merged, config = resolve_run_config({"x-level": 2}, tmp_path)
    assert merged["x-level"] == 2 and dict(config.extra) == {"x-level": 2}
