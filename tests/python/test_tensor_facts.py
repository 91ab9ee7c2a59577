"""The hooks' one-call tensor reader (bindings/python/ext/torch_facts.h):
built against the running torch's own headers, it must read exactly what
torch's Python getters say, and decline (None) every tensor it does not
handle, which then takes the getters' path. Runs where this build has the
module for the running torch; elsewhere it checks that the getters path is
the one in use."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
import ferry.torch as ft  # noqa: E402
from ferry import _ferry  # noqa: E402

ACTIVE = _ferry.tensor_facts_active()


def test_active_where_built():
    """ferry.torch loads the module named after this torch when the build
    made it; run.sh says where one must be (the torch 2.x wheel)."""
    here = os.path.dirname(ferry.__file__)
    tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    built = any(f.startswith(f"_torchfacts_{tag}.") for f in os.listdir(here))
    assert ACTIVE == built, (ACTIVE, built, os.listdir(here))
    if os.environ.get("FERRY_EXPECT_TORCH_FACTS") == "1":
        assert ACTIVE, "this interpreter's package was built with the tensor-facts module"


_codes = {}


def _dtype_codes():
    # c10::ScalarType codes, as the module reports them, learned from
    # one tensor of each dtype
    if not _codes:
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                   torch.uint8, torch.bool, torch.float64, torch.complex64):
            f = _ferry.tensor_facts(torch.zeros(1, dtype=dt))
            if f is not None:
                _codes[dt] = f[0]
    return _codes


@pytest.mark.skipif(not ACTIVE, reason="no tensor-facts module for this torch in this build")
def test_reads_what_the_getters_say():
    base = torch.randn(6, 8, 10)
    cases = {
        "contiguous": base,
        "0-dim": torch.tensor(3.0),
        "empty": torch.empty(0, 5),
        "transposed": base.transpose(0, 2),
        "offset view": base[2:, 3:],
        "parameter": torch.nn.Parameter(torch.randn(4, 4)),
        "requires grad output": torch.randn(5, requires_grad=True) * 2,
        "bf16": base.to(torch.bfloat16),
        "int64": torch.arange(12).view(3, 4),
        "bool": base > 0,
        "8 dims": torch.zeros([1] * 8),
        "expanded": torch.randn(3, 1).expand(3, 7),
        "meta (no data: 0, as data_ptr() says; the hooks then take the full path)":
            torch.empty(3, device="meta"),
    }
    codes = _dtype_codes()
    for name, t in cases.items():
        f = _ferry.tensor_facts(t)
        assert f is not None, name
        st, sizes, ptr, version, is_view = f
        assert codes[t.dtype] == st, name
        assert sizes == tuple(t.shape), name
        assert ptr == t.data_ptr(), name
        assert version == t._version, name
        # the keep path reads Tensor._base only of a view (kind_of_tensor)
        assert is_view == (t._base is not None), name
    t = torch.zeros(4)
    t.add_(1)
    t.mul_(2)
    assert _ferry.tensor_facts(t)[3] == t._version == 2


@pytest.mark.skipif(not ACTIVE, reason="no tensor-facts module for this torch in this build")
def test_declines_what_it_does_not_handle():
    with torch.inference_mode():
        inf = torch.zeros(3)
    declined = {
        "9 dims": torch.zeros([1] * 9),
        "sparse": torch.zeros(3, 3).to_sparse(),
        "inference tensor (no version counter)": inf,
    }
    for name, t in declined.items():
        assert _ferry.tensor_facts(t) is None, name

    class Sub(torch.Tensor):
        pass

    assert _ferry.tensor_facts(torch.zeros(2).as_subclass(Sub)) is None  # not an exact type
    assert _ferry.tensor_facts("not a tensor") is None


def test_getters_path_without_it():
    """FERRY_TORCH_FACTS=0: the hooks read through torch's getters, and a
    keep still comes back bit-identical with torch's in-place check."""
    code = (
        "import torch, ferry.torch as ft, ferry._ferry as F\n"
        "assert not F.tensor_facts_active()\n"
        "w = torch.randn(64, 64, requires_grad=True)\n"
        "with ft.offload(None, policy='default'):\n"
        "    y = (w * w).sum()\n"
        "y.backward()\n"
        "assert torch.equal(w.grad, 2 * w.detach())\n"
        "print('ok')\n")
    env = dict(os.environ, FERRY_TORCH_FACTS="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_in_place_change_is_caught_through_it():
    """The version read at pack and at unpack comes from the module when it
    is active: an in-place change between them is torch's error."""
    x = torch.randn(256, 256, requires_grad=True)
    with ft.offload(None, policy="default"):
        y = x.exp()  # saves its output (1 KiB and more: through the engine)
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
