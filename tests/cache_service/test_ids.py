"""`cache_service.ids`: the request and replica ids every layer mints (exact formats)."""

from __future__ import annotations

import re

from cache_service.ids import new_request_id, replica_id


def test_request_ids_are_req_and_16_hex_digits_and_differ():
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"req-[0-9a-f]{16}", i) for i in ids)


def test_replica_ids_count_up_from_their_number():
    assert [replica_id(n) for n in (0, 1, 12)] == ["replica-0", "replica-1", "replica-12"]
