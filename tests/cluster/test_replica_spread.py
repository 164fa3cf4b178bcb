"""`ReplicaSet.spread`: where new replicas go (no Ray: its node table faked). The fewest replicas
first; a node that just lost a replica (died, stopped answering: a lost or partitioned host Ray
still calls alive) last, unless no other node can take one; a replica removed on purpose marks nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.config import ClusterConfig
from cluster.control import replica_set
from cluster.control.replica_count import REMOVED
from cluster.control.replica_set import ReplicaHandle, ReplicaSet


class _Actor:
    class shutdown:  # noqa: N801 - an actor method's shape: .remote()
        @staticmethod
        def remote():
            return None


@pytest.fixture
def make_set(monkeypatch):
    nodes = [{"NodeID": n, "Alive": True, "Resources": {"CPU": 1.0}} for n in ("a", "b", "c")]
    monkeypatch.setattr(replica_set.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(replica_set.ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(replica_set.ray, "get", lambda *a, **k: None)

    def make(placed: dict[str, str]) -> ReplicaSet:
        s = ReplicaSet("model", None, ClusterConfig(name=None), "c", None, "secret", object)
        for rid, node in placed.items():
            s.replicas[rid] = ReplicaHandle(rid, _Actor(), SimpleNamespace(node_id=node))
        return s

    return make


def test_fewest_replicas_first(make_set):
    s = make_set({"r0": "a", "r1": "b"})
    assert s.spread(3) == ["c", "a", "b"]


def test_a_node_that_lost_a_replica_comes_last(make_set):
    s = make_set({"r0": "a", "r1": "b", "r2": "c"})
    assert s.purge("r2", "stopped answering")
    assert s.spread(1) == ["a"]  # c holds none now, but it lost one: a and b first
    assert s.spread(3) == ["a", "b", "a"]  # never c while another node can take one
    assert s.purge("r0", "died") and s.purge("r1", "died")
    assert s.spread(1) == ["a"]  # every node suspect: the fewest replicas again


def test_a_replica_removed_on_purpose_marks_nothing(make_set):
    s = make_set({"r0": "a", "r1": "b", "r2": "c"})
    assert s.purge("r2", REMOVED)
    assert s.spread(1) == ["c"]
