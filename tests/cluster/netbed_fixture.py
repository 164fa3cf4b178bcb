"""The multi-host bed (`bench.netbed`) as a pytest fixture. A test module imports it:

    from tests.cluster.netbed_fixture import netbed  # noqa: F401  (a fixture, used by name)

`netbed` is one 3-host bed with Ray for the importing module; where namespaces cannot be made
here (not root, no iproute2, namespaces refused) every test using it is skipped with the reason.
Its teardown asserts the bed left nothing behind."""

from __future__ import annotations

import pytest

from bench.netbed import BedSpec, NetBed, unavailable_reason


def require_netbed() -> None:
    if reason := unavailable_reason():
        pytest.skip(f"multi-host bed unavailable: {reason}")


@pytest.fixture(scope="module")
def netbed():
    require_netbed()
    with NetBed(BedSpec(num_hosts=3)) as bed:
        yield bed
    assert bed.leftovers() == [], "the bed left these behind"
