"""Request and replica ids, minted here and nowhere else (the index keys everything by them).

    request   "req-<16 hex>"   unique across front doors, engines and processes without a counter
    replica   "replica-<n>"    n counts up per cluster (or per simulation)

Cluster actor names (controller, cache service, front doors) are in `cluster.ids`.
"""

from __future__ import annotations

import secrets


def new_request_id() -> str:
    return f"req-{secrets.token_hex(8)}"


def replica_id(n: int) -> str:
    return f"replica-{n}"
