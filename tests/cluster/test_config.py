"""Configuration: precedence, sources, LMCache aliases, clear errors on bad values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.config import FIELD_SECTION, LMCACHE_KEYS, describe_fields, load_config

pytestmark = pytest.mark.cluster


def test_defaults_match_the_brief():
    cfg = load_config(environ={})
    assert cfg.blend.check_layers == (1,)
    assert cfg.blend.recompute_ratios == (0.15,)
    assert cfg.blend.min_tokens == 256
    assert cfg.tiers.chunk_size == 256
    assert set(cfg.sources.values()) == {"default"}


def test_precedence_defaults_yaml_env_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("recompute_ratios: [0.3]\nmin_tokens: 100\nchunk_size: 128\n")
    env = {"KVBLEND_MIN_TOKENS": "50", "LMCACHE_CHUNK_SIZE": "64"}
    cfg = load_config(str(f), overrides={"chunk_size": 32}, environ=env)
    assert cfg.blend.recompute_ratios == (0.3,)
    assert cfg.sources["recompute_ratios"] == f"file {f}"
    assert cfg.blend.min_tokens == 50 and cfg.sources["min_tokens"] == "env KVBLEND_MIN_TOKENS"
    assert cfg.tiers.chunk_size == 32 and cfg.sources["chunk_size"] == "cli"


def test_env_overrides_file_unlike_lmcache(tmp_path):
    f = tmp_path / "lm.yaml"
    f.write_text("blend_recompute_ratios: [0.5]\nmax_local_cpu_size: 3\n")
    cfg = load_config(environ={"LMCACHE_CONFIG_FILE": str(f), "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.2"})
    assert cfg.blend.recompute_ratios == (0.2,)
    assert cfg.tiers.host_size_gib == 3.0  # GiB 1:1


@pytest.mark.parametrize("var", ["LMCACHE_BLEND_RECOMPUTE_RATIOS", "KVBLEND_RECOMPUTE_RATIOS"])
def test_malformed_env_names_the_variable(var):
    with pytest.raises(ValueError, match=var):
        load_config(environ={var: "abc"})


def test_out_of_range_names_field_and_allowed():
    with pytest.raises(ValueError, match=r"recompute_ratios.*0\.0\.\.1\.0"):
        load_config(environ={"KVBLEND_RECOMPUTE_RATIOS": "1.5"})
    with pytest.raises(ValueError, match="eviction_policy"):
        load_config(environ={"KVBLEND_EVICTION_POLICY": "fifo"})


def test_unknown_keys_stop_startup(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("recompute_ratio: 0.2\n")  # typo: missing s
    with pytest.raises(ValueError, match="recompute_ratio"):
        load_config(str(f), environ={})
    with pytest.raises(ValueError, match="KVBLEND_NOPE"):
        load_config(environ={"KVBLEND_NOPE": "1"})
    with pytest.raises(ValueError, match="bogus"):
        load_config(overrides={"bogus": 1}, environ={})


def test_lmcache_meaningless_settings_warn(caplog):
    cfg = load_config(environ={"LMCACHE_USE_LAYERWISE": "True", "LMCACHE_LOCAL_CPU": "False"})
    assert "LMCACHE_USE_LAYERWISE" in caplog.text and "LMCACHE_LOCAL_CPU" in caplog.text
    assert cfg.tiers.host_size_gib == 4.0


def test_every_lmcache_seed_variable_is_accepted():
    env = {"LMCACHE_ENABLE_BLENDING": "True", "LMCACHE_BLEND_SPECIAL_STR": " # # ",
           "LMCACHE_USE_LAYERWISE": "True", "LMCACHE_BLEND_CHECK_LAYERS": "1",
           "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15", "LMCACHE_BLEND_THRESHOLDS": "",
           "LMCACHE_BLEND_MIN_TOKENS": "64", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "5", "LMCACHE_LOCAL_DISK": "file:///tmp/x",
           "LMCACHE_MAX_LOCAL_DISK_SIZE": "7"}
    cfg = load_config(environ=env)
    assert cfg.blend.blend_separator == " # # "
    assert cfg.blend.min_tokens == 64
    assert cfg.tiers.disk_path == "/tmp/x" and cfg.tiers.disk_size_gib == 7.0
    assert cfg.tiers.host_size_gib == 5.0


def test_every_field_is_documented_with_type():
    rows = describe_fields()
    assert {r["name"] for r in rows} == set(FIELD_SECTION)
    assert all(r["doc"] for r in rows)
    for target in LMCACHE_KEYS.values():
        if isinstance(target, tuple):
            assert target[0] in FIELD_SECTION


def test_ratios_pair_with_check_layers():
    with pytest.raises(ValueError, match="one per check layer"):
        load_config(environ={"KVBLEND_CHECK_LAYERS": "1,3", "KVBLEND_RECOMPUTE_RATIOS": "0.1,0.2,0.3"})
    cfg = load_config(environ={"KVBLEND_CHECK_LAYERS": "1,3", "KVBLEND_RECOMPUTE_RATIOS": "0.3,0.15"})
    assert cfg.blend.ratio_for(1) == 0.15


def _kvblend(*args, env=None):
    import os

    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBLEND_", "LMCACHE_"))}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", *args], capture_output=True, text=True, env=e)


def test_cli_config_show_reports_value_and_source():
    r = _kvblend("config", "show", "--json", env={"LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.2"})
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads(r.stdout)
    assert data["recompute_ratios"] == {"value": [0.2], "source": "env LMCACHE_BLEND_RECOMPUTE_RATIOS"}


def test_cli_config_show_rejects_bad_value():
    r = _kvblend("config", "show", env={"LMCACHE_BLEND_RECOMPUTE_RATIOS": "abc"})
    assert r.returncode != 0
    assert "LMCACHE_BLEND_RECOMPUTE_RATIOS" in r.stderr and "Traceback" not in r.stderr


def test_lmcache_blend_settings_keep_cacheblend_selection(tmp_path):
    """Issue 17: LMCache's blend variables (env, LMCache file or extra config) mean CacheBlend's
    K deviation unless ``selection`` is named; our own keys get our default."""
    from blend.config import BlendConfig

    ours = load_config(environ={"KVBLEND_RECOMPUTE_RATIOS": "0.2"})
    assert ours.blend.selection == BlendConfig().selection
    assert load_config(environ={"LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.2"}).blend.selection == "k_deviation"
    f = tmp_path / "lm.yaml"
    f.write_text("blend_check_layers: [1]\n")
    cfg = load_config(environ={"LMCACHE_CONFIG_FILE": str(f)})
    assert cfg.blend.selection == "k_deviation" and "LMCache" in cfg.sources["selection"]
    assert load_config(overrides={"blend_recompute_ratios": [0.3]}, environ={}).blend.selection == "k_deviation"
    named = load_config(environ={"LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.2", "KVBLEND_SELECTION": "query_attention"})
    assert named.blend.selection == "query_attention"
    with pytest.raises(ValueError, match="selection"):
        load_config(environ={"KVBLEND_SELECTION": "random"})


@pytest.mark.parametrize("call", ["call_timeout_s", "io_timeout_s"])
def test_a_per_call_timeout_longer_than_its_stage_deadline_stops_startup(call):
    """Issue 20: ``call_timeout_s`` and ``io_timeout_s`` serve a worker's read of cached
    layers, which the blend waits for ``load_timeout_s``; longer ones are refused, naming both
    settings, their values and where they came from."""
    env = {f"KVBLEND_{call.upper()}": "5"}
    with pytest.raises(ValueError) as err:
        load_config(environ=env, overrides={"load_timeout_s": 3.0})
    msg = str(err.value)
    assert f"{call}=5 (from env KVBLEND_{call.upper()})" in msg and "load_timeout_s=3 (from cli)" in msg
    assert load_config(environ=env, overrides={"load_timeout_s": 5.0}).get(call) == 5.0  # equal: fine


def test_default_timeouts_fit_their_stage_deadlines():
    cfg = load_config(environ={})
    assert cfg.get("io_timeout_s") <= cfg.get("load_timeout_s")
    assert cfg.get("call_timeout_s") <= cfg.get("load_timeout_s")
