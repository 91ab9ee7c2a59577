"""The Python examples people copy run as they are (tiny, on CPU): each is a
subprocess of this interpreter, skipped only where it needs a library this
interpreter lacks (lightning, transformers and accelerate are in the torch
2.x venv, not in Debian's torch 1.13)."""
import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = [("torchtune_recipe.py", []), ("lightning_train.py", ["lightning"]),
            ("hf_trainer.py", ["transformers", "accelerate"]),
            ("accelerate_loop.py", ["accelerate"])]


@pytest.mark.parametrize("script,needs", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs(script, needs):
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{script} needs {', '.join(missing)}")
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", script), "--steps", "2"],
                         capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "offloaded" in out.stdout
