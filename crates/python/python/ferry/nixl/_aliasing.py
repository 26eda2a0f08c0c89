"""``import nixl``, ``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging``
giving Ferry's modules (see ``ferry._alias``)."""

from ferry._alias import Alias

#: The environment variable that turns the alias on in every process (the ``.pth`` hook).
ENV = "FERRY_AS_NIXL"

ALIAS = Alias(
    "nixl",
    {
        "nixl": "ferry.nixl",
        "nixl._api": "ferry.nixl._api",
        "nixl._bindings": "ferry.nixl._bindings",
        "nixl._utils": "ferry.nixl._utils",
        "nixl.logging": "ferry.nixl.logging",
    },
    ENV,
    "ferry.nixl",
)


def install() -> None:
    """Makes ``nixl`` and its modules the connector imports resolve to Ferry in this process."""
    ALIAS.install()


def installed() -> bool:
    """Whether the alias is on in this process."""
    return ALIAS.installed()
