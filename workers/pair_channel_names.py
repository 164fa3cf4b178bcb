"""The names of the pair channels between replicas, built here only: the controller names the
channel it renews (`cluster.control.handoffs`, `transfers`), the replicas the ones they open
(`workers.transfer_replica`, `handoff_replica`).

    "<src>-><dst>#<gen>"    prefix pages src -> dst, generation gen (`workers.transfer`)
    "<src>-><dst>#h<gen>"   hand-offs src -> dst, generation gen (`workers.handoff_transfer`)

Each kind counts its own generations (`cluster.control.pair_channels`); a renewed pair gets a
new name, so its rendezvous never meets a dropped channel's keys left in the sender's store.
"""

from __future__ import annotations


def transfer_channel_name(src: str, dst: str, generation: int) -> str:
    """The channel prefix pages travel on from `src` to `dst`."""
    return f"{src}->{dst}#{generation}"


def handoff_channel_name(src: str, dst: str, generation: int) -> str:
    """The channel requests are handed off on from `src` to `dst`."""
    return f"{src}->{dst}#h{generation}"


def channel_ends(name: str) -> tuple[str, ...]:
    """The two replicas a channel named here joins: (src, dst)."""
    return tuple(name.split("#")[0].split("->"))
