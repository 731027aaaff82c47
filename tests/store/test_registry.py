"""Store specs: a parameter the backend does not read is named, not ignored."""

import pytest

from hetserve.errors import InvalidInputError


def test_a_store_parameter_the_backend_does_not_use_is_named():
    """A typo in a store spec (or a parameter the rest of it leaves unused) was ignored."""
    from hetserve.store.registry import open_store

    with pytest.raises(InvalidInputError, match="does not use parameter 'dramm'"):
        open_store("local://?dramm=1G")
    with pytest.raises(InvalidInputError, match="does not use parameter 'ssd' here"):
        open_store("local://?dram=16M&ssd=1G")  # no ssd_dir: no SSD tier to size
    open_store("local://?dram=16M&token=x").close()  # a secret may go unused
