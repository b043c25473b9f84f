"""The README's main command and the benchmarks stay runnable (small sizes; numbers not checked)."""

import json

import pytest

from tests.conftest import run_preload


@pytest.mark.slow
def test_demo_runs_the_whole_story(default_model):
    out = run_preload("demo", "--repeats", "1", timeout=600)
    assert out.returncode == 0, out.stderr
    assert "warm (ipc_cache)" in out.stdout and "Paris" in out.stdout


@pytest.mark.slow
def test_bench_restart_and_attach_produce_json(tiny_llama, tmp_path):
    out = run_preload("bench", "restart", tiny_llama, "--repeats", "1", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)["summary"]
    assert summary["warm (ipc_cache)"]["n"] == 1 and summary["ratios"]["weights_cold_over_warm"] > 0
    out = run_preload("bench", "attach", "--sizes-gb", "0.01", "--repeats", "1", "--json", timeout=600,
                      env_extra={"PRELOAD_BENCH_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"][0]["attach_ms_median"] > 0
