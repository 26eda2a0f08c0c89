"""Who may speak for a name: the rule by which the NIXL and Mooncake layers file peers'
notifications (and NIXL's metadata and invalidations), decided without I/O.

A notification names its sender (``nixl_agent``'s name, a ``TransferNotify``'s ``name``), and
that name is only a claim. What the engine proved is the sender's key name (with keys) and the
incarnation (peer id and epoch) its handshake named: bound to that key's proof with keys, only
claimed without. ``Bindings`` keeps, for each name, the incarnation that speaks for it, and
takes a message naming ``name`` only when:

1. the sender proved a key named ``name`` (a key bound to that name: per-peer keyrings whose key
   names are the agents' names); or else
2. ``name`` is not the name of a key of this engine's keyring (a name with a key of its own is
   spoken for by that key alone, whatever incarnation a sender claims), and
3. the sender is the incarnation bound to ``name``: the one recorded when its metadata was
   loaded (by the application, from a store or through the data-plane handshake), or, for a
   name nothing recorded yet, the first that spoke for it. Where keys are in use, the key that
   incarnation proved first is part of it.

Anything else is refused (the caller logs and drops it). Without keys, rule 3 is all there is,
and a peer id and epoch are only claimed: anyone on the network who learns them (any handshake
with that engine tells them) can speak for the name. See docs/nixl.md and docs/mooncake.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

#: Names bound by their first speaker that are kept at most; past it the oldest of them is
#: forgotten (names the application bound are never forgotten).
MAX_FIRST_COME = 65_536


@dataclass(frozen=True)
class Sender:
    """A message's sender as the engine knows it: the incarnation its handshake named and the
    key it proved (None without keys)."""

    peer_id: str
    epoch: str
    key: Optional[str] = None

    def __str__(self) -> str:
        key = f" key {self.key!r}" if self.key is not None else " (no key)"
        return f"peer {self.peer_id} epoch {self.epoch}{key}"


@dataclass
class _Binding:
    peer_id: str
    epoch: str
    #: The key the incarnation proved (the first time it spoke, if it was recorded keyless).
    key: Optional[str]


class Bindings:
    """Names and the incarnations that speak for them (see the module's docs). Not
    thread-safe: the caller holds its own lock."""

    def __init__(self, key_names: Iterable[str] = (), max_first_come: int = MAX_FIRST_COME):
        self._keyed = frozenset(key_names)
        self._max = max_first_come
        #: Names the application bound (loaded metadata, this engine's own name).
        self._pinned: dict[str, _Binding] = {}
        #: Names their first speaker bound, oldest first.
        self._first: OrderedDict[str, _Binding] = OrderedDict()

    @property
    def keyed(self) -> bool:
        """Whether this engine runs with keys."""
        return bool(self._keyed)

    def _get(self, name: str) -> Optional[_Binding]:
        return self._pinned.get(name) or self._first.get(name)

    def bind(self, name: str, peer_id: str, epoch: str) -> None:
        """Records that incarnation ``peer_id``/``epoch`` is ``name`` (the application loaded
        its metadata, or a message the rules took said so)."""
        old = self._pinned.pop(name, None) or self._first.pop(name, None)
        same = old is not None and (old.peer_id, old.epoch) == (peer_id, epoch)
        self._pinned[name] = _Binding(peer_id, epoch, old.key if old and same else None)

    def unbind(self, name: str) -> None:
        """Forgets ``name``: the next sender to speak for it binds it."""
        self._pinned.pop(name, None)
        self._first.pop(name, None)

    def bound(self, name: str) -> Optional[tuple[str, str]]:
        """The incarnation (peer id, epoch) bound to ``name``, if any."""
        b = self._get(name)
        return None if b is None else (b.peer_id, b.epoch)

    def check(self, name: str, sender: Sender) -> Optional[str]:
        """None when ``sender`` speaks for ``name`` (binding the name if nothing had), else why
        it does not."""
        b = self._get(name)
        if sender.key is not None and sender.key == name:
            if b is None:
                self._first_come(name, sender)
            elif (b.peer_id, b.epoch) != (sender.peer_id, sender.epoch):
                # The key bound to the name speaks for every incarnation of it.
                b.peer_id, b.epoch, b.key = sender.peer_id, sender.epoch, sender.key
            return None
        if sender.key is not None and name in self._keyed:
            return f"{name!r} has a key of its own, and the sender proved key {sender.key!r}"
        if b is None:
            self._first_come(name, sender)
            return None
        if (b.peer_id, b.epoch) != (sender.peer_id, sender.epoch):
            return f"{name!r} is peer {b.peer_id} epoch {b.epoch}"
        if b.key is None:
            b.key = sender.key
        elif b.key != sender.key:
            return f"{name!r} proved key {b.key!r}"
        return None

    def _first_come(self, name: str, sender: Sender) -> None:
        self._first[name] = _Binding(sender.peer_id, sender.epoch, sender.key)
        while len(self._first) > self._max:
            self._first.popitem(last=False)
