"""Issue 38 review: bench_optim.py's ratio is a median of paired ratios; its
JSON must say so, with how many pairs, their spread around it and the ratio
of the two modes' medians beside it (a pairing that flattered the offload
would show as a gap between the two)."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_json_records_method_pairs_and_spread(tmp_path):
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"other_metric": 1}))
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_optim.py"), "--json", str(out),
                    "--reps", "5", "--dim", "32", "--blocks", "1"], check=True, capture_output=True,
                   timeout=300)
    data = json.loads(out.read_text())
    assert data["other_metric"] == 1  # merged, not overwritten
    assert "median of per-pair" in data["optimizer_offload_step_ratio_method"]
    assert data["optimizer_offload_step_pairs"] == 5
    r = data["optimizer_offload_step_ratio"]
    assert data["optimizer_offload_step_ratio_p25"] <= r <= data["optimizer_offload_step_ratio_p75"]
    assert data["optimizer_offload_step_ratio_of_medians"] > 0
