"""The PyTorch adapter in real multi-rank jobs, under both launchers and several world sizes."""
import pytest

from multirank import matrix, run

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("launcher,np", matrix())
def test_semantics(launcher, np):
    output = run(launcher, np, "torch_semantics.py")
    assert output.count("all checks passed") == np, output
