"""The package as users get it: what `pip install .` puts in site-packages
(tests/python/run.sh runs every test against that wheel; these check the
installed pieces themselves)."""
import os
import shutil
import subprocess
import sys

import pytest

import ferry

INSTALLED = os.environ.get("FERRY_EXPECT_INSTALLED")
installed_only = pytest.mark.skipif(not INSTALLED, reason="runs against the installed wheel "
                                    "(tests/python/run.sh)")


def test_missing_extension_is_a_clear_import_error(tmp_path):
    # a copy of the package without its C extension, as a broken install
    # (or a missing LuaJIT, which makes the extension fail to load) leaves it
    pkg = os.path.dirname(ferry.__file__)
    shutil.copytree(pkg, tmp_path / "ferry",
                    ignore=lambda d, names: [n for n in names if n.startswith("_ferry")])
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import ferry"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "ferry: the C extension ferry._ferry does not load" in r.stderr
    assert "libluajit" in r.stderr


@installed_only
def test_installed_command_runs_with_the_packaged_policies(tmp_path):
    exe = os.path.join(INSTALLED, "bin", "ferry")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_POLICY")}
    r = subprocess.run([exe, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ferry.__version__ in r.stdout
    # run from an empty directory: nothing of the source tree is reachable
    r = subprocess.run([exe, "check", "default"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    pkg = os.path.dirname(ferry.__file__)
    assert os.path.realpath(pkg).startswith(os.path.realpath(INSTALLED))
    for rel in ("py.typed", "policies/default.lua", "policies/lib/ferry/rules.lua", "bin/ferry"):
        assert os.path.exists(os.path.join(pkg, rel)), rel


@installed_only
def test_policy_by_bare_name_resolves_inside_the_package():
    path = ferry.policy_path("budget")
    assert os.path.realpath(path).startswith(os.path.realpath(os.path.dirname(ferry.__file__)))
