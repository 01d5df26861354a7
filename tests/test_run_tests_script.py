"""scripts/run-tests.sh with test paths runs those tests only (and no ctest)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under run-sanitized.sh: the sanitizer would be preloaded into the script's own builds")
def test_named_tests_select_them_and_skip_ctest():
    node = "tests/test_docs.py::test_the_public_surface_is_all_covered"
    got = subprocess.run(["scripts/run-tests.sh", node, "tests/test_docs.py::test_pool_views_are_the_documented_classes",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "2 passed" in got.stdout and "deselected" not in got.stdout, got.stdout
    assert "ctest skipped" in got.stderr and "Test project" not in got.stdout


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under run-sanitized.sh: the sanitizer would be preloaded into the script's own builds")
def test_what_is_not_run_is_one_line_a_group_with_its_command(tmp_path):
    """The skipped tests in one line a group, each naming the command that runs them;
    tests/sglang without SGLang's venv likewise."""
    env = {**os.environ, "SWA_EXT_CUDA_VENV": str(tmp_path / "no-venv")}
    got = subprocess.run(["scripts/run-tests.sh", "tests/test_soak.py", "tests/sglang/test_adapter.py",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert got.returncode == 0, got.stdout + got.stderr
    lines = (got.stdout + got.stderr).splitlines()
    not_run = [line for line in lines if line.startswith("not run: ")]
    assert ("not run: 1 slow tests (the soak, long property-test budgets, the documented long runs, tests/sglang's "
            "further engine, PD and fault configurations): scripts/run-tests.sh --slow") in not_run
    assert any(line.startswith("not run: tests/sglang (") and line.endswith(
        ": scripts/setup-sglang.sh, then scripts/run-tests.sh") for line in not_run), not_run
    assert "SKIPPED [" not in got.stdout  # not pytest's per-test list
