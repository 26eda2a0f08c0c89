"""``import mooncake`` and ``import mooncake.engine`` giving Ferry's modules (see ``ferry._alias``)."""

from ferry._alias import Alias

#: The environment variable that turns the alias on in every process (the ``.pth`` hook).
ENV = "FERRY_AS_MOONCAKE"

ALIAS = Alias(
    "mooncake",
    {"mooncake": None, "mooncake.engine": "ferry.mooncake.engine"},
    ENV,
    "ferry.mooncake",
)


def install() -> None:
    """Makes ``mooncake`` and ``mooncake.engine`` resolve to Ferry in this process (a
    ``mooncake`` imported before stays what it is)."""
    ALIAS.install()


def installed() -> bool:
    """Whether the alias is on in this process."""
    return ALIAS.installed()


def _from_env() -> None:
    ALIAS.from_env()
