"""What the Python benchmarks share: finding the built ferry package, writing
a policy file, and merging metrics into the flat JSON object of --json."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def import_ferry(json_path):
    """ferry and ferry.torch: installed, else built beside the --json file
    (build/python), else in the source tree's build/python."""
    try:
        import ferry  # noqa: F401
    except ImportError:
        for d in ([os.path.join(os.path.dirname(os.path.abspath(json_path)), "python")]
                  if json_path else []) + [os.path.join(HERE, "..", "build", "python")]:
            if os.path.isdir(os.path.join(d, "ferry")):
                sys.path.insert(0, d)
                break
    import ferry
    import ferry.torch
    return ferry


def write_policy(d, name, src):
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(src)
    return path


def merge_json(path, metrics):
    """Adds metrics to the JSON object in path (atomically: other benchmarks
    write the same file)."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            text = f.read().strip()
        data = json.loads(text) if text else {}
    data.update(metrics)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
