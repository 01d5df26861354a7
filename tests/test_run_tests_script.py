"""scripts/run-tests.sh with test paths runs those tests only (and no ctest)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under run-sanitized.sh: the script's setup-env.sh would rebuild the sanitized extension")
def test_named_tests_select_them_and_skip_ctest():
    node = "tests/test_docs.py::test_the_public_surface_is_all_covered"
    got = subprocess.run(["scripts/run-tests.sh", node, "tests/test_docs.py::test_pool_views_are_the_documented_classes",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "2 passed" in got.stdout and "deselected" not in got.stdout, got.stdout
    assert "ctest skipped" in got.stderr and "Test project" not in got.stdout
