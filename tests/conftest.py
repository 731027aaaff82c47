import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(family, **make_tiny_checkpoint kwargs) -> checkpoint dir (cached)."""
    from hetserve.testing import make_tiny_checkpoint

    made: dict = {}

    def make(family: str, **kwargs):
        key = (family, repr(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(family.replace("-", "_"))
            made[key] = make_tiny_checkpoint(family, out, **kwargs)
        return made[key]

    return make
