"""NIXL's telemetry exporter on Ferry: the Prometheus series of NIXL's exporter plug-in
(``agent_tx_bytes_total``, ``agent_tx_last_bytes``, ``agent_xfer_time``, ...), labelled by
``hostname`` and ``agent_name``, served by Ferry's own metrics endpoint beside Ferry's series.

As NIXL: an agent whose telemetry is on (``NIXL_TELEMETRY_ENABLE``, else ``capture_telemetry``)
with ``NIXL_TELEMETRY_EXPORTER=prometheus`` exports; the endpoint is
``0.0.0.0:$NIXL_TELEMETRY_PROMETHEUS_PORT`` (default 9090), or 127.0.0.1 with
``NIXL_TELEMETRY_PROMETHEUS_LOCAL``; the agents of a process share it; an agent name is taken
once; ``NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US`` overrides the time histograms' bounds.

Ferry's part: the series are recorded in ``ferry::agent_telemetry`` and every metrics endpoint
of the process serves them, so when one is already on (any Ferry engine here started with
``metrics=``), no second HTTP server is opened.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from typing import Any, Callable, Optional, TypeVar

from ferry import _ferry
from ferry.nixl._bindings import _NixlError

logger = logging.getLogger("ferry.nixl")

DEFAULT_PORT = 9090
_TRUE = ("y", "yes", "on", "1", "true", "enable")
_FALSE = ("n", "no", "off", "0", "false", "disable")


def _flag(var: str) -> bool:
    """A NIXL boolean variable: unset or empty is False; else one of NIXL's words (any case),
    anything else ``RuntimeError`` as NIXL's configuration parser refuses it."""
    value = os.environ.get(var, "").strip()
    if not value:
        return False
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise RuntimeError(f"{var}={value!r}: known are {', '.join(_TRUE)} as positive and "
                       f"{', '.join(_FALSE)} as negative (case insensitive)")


def _port() -> int:
    value = os.environ.get("NIXL_TELEMETRY_PROMETHEUS_PORT", "").strip()
    if not value:
        return DEFAULT_PORT
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise RuntimeError(f"NIXL_TELEMETRY_PROMETHEUS_PORT={value!r} is not a port (0-65535)")
    return port


def _bounds() -> Optional[list[int]]:
    """``NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US``: strictly increasing positive microseconds,
    comma separated; unset or empty is NIXL's default. Ferry keeps whole microseconds."""
    spec = os.environ.get("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "")
    if not spec:
        return None
    try:
        bounds = [float(t) for t in spec.split(",")]
    except ValueError:
        bounds = []
    ok = bounds and all(b > 0 and b == int(b) for b in bounds) and all(
        a < b for a, b in zip(bounds, bounds[1:]))
    if not ok:
        raise ValueError("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US must be a comma-separated list of "
                         f"strictly-increasing positive whole microseconds, not {spec!r}")
    return [int(b) for b in bounds]


def exporter(agent_name: str, enabled: bool) -> tuple[Optional[Any], Optional[str]]:
    """What an agent whose telemetry is ``enabled`` exports: its ``_ferry.AgentTelemetry``
    (None without the Prometheus exporter) and the address its engine should serve metrics
    on (None when an endpoint of this process already serves them, or without the exporter).
    Bad variables raise as NIXL's agent constructor does (``RuntimeError``, ``ValueError``)."""
    name = os.environ.get("NIXL_TELEMETRY_EXPORTER", "").strip()
    if not enabled or not name:
        return None, None
    if name.lower() != "prometheus":
        logger.warning("NIXL_TELEMETRY_EXPORTER=%s: Ferry serves NIXL's prometheus exporter only; "
                       "agent %r keeps its per-transfer telemetry and exports nothing",
                       name, agent_name)
        return None, None
    local, port, bounds = _flag("NIXL_TELEMETRY_PROMETHEUS_LOCAL"), _port(), _bounds()
    try:
        tm = _ferry.AgentTelemetry(agent_name, socket.gethostname(), bounds)
    except _ferry.FerryError as e:
        raise RuntimeError(f"Prometheus exporter: {e}") from e
    live = _ferry.metrics_endpoints()
    if live:
        logger.info("NIXL agent %r: its Prometheus series are served with Ferry's metrics on %s",
                    agent_name, ", ".join(live))
        return tm, None
    return tm, f"{'127.0.0.1' if local else '0.0.0.0'}:{port}"


F = TypeVar("F", bound=Callable[..., Any])


def error(tm: Optional[Any], status: str) -> None:
    """Counts one error of the agent's API (``agent_errors_total{status}``), if it exports."""
    if tm is not None:
        tm.error(status)


def counted(method: F) -> F:
    """``method`` with its NIXL exceptions counted by their status, as NIXL counts the errors
    its transfer calls return."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except _NixlError as e:
            error(self._tm, e.status[len("NIXL_ERR_"):].lower())
            raise

    return call  # type: ignore[return-value]


#: The transfer calls whose errors NIXL counts (``prepXferDlist``, ``makeXferReq``,
#: ``createXferReq``, ``postXferReq``, ``getXferStatus``).
COUNTED = ("prep_xfer_dlist", "make_prepped_xfer", "initialize_xfer", "transfer",
           "check_xfer_state")
_COUNTING: dict[type, type] = {}


def counting(cls: type) -> type:
    """``cls`` (``nixl_agent`` or a subclass) with its transfer calls ``counted``: the class of
    an agent that exports, so that an agent that does not pays no wrapper on its hot calls."""
    if cls not in _COUNTING:
        wrapped = {name: counted(getattr(cls, name)) for name in COUNTED}
        _COUNTING[cls] = type(cls.__name__, (cls,), {**wrapped, "__module__": cls.__module__,
                                                      "__qualname__": cls.__qualname__})
    return _COUNTING[cls]


def make_engine(listen: str, metrics: Optional[str], agent_name: str) -> Any:
    """The agent's engine, serving metrics on ``metrics`` when given. A metrics address that
    cannot be bound (another process holds the port) is a warning, as in NIXL, and the engine
    is made without it."""
    if metrics is None:
        return _ferry.Engine(listen=listen)
    try:
        engine = _ferry.Engine(listen=listen, metrics=metrics)
    except _ferry.FerryError as e:
        engine = _ferry.Engine(listen=listen)
        live = _ferry.metrics_endpoints()
        if live:  # another agent of this process opened one meanwhile: it serves ours too
            logger.info("NIXL agent %r: its Prometheus series are served on %s",
                        agent_name, ", ".join(live))
        else:
            logger.warning("Prometheus telemetry endpoint %s could not be bound (%s); agent %r "
                           "runs without a telemetry endpoint", metrics, e, agent_name)
        return engine
    logger.info("Prometheus exporter initialized on %s (Ferry's metrics and NIXL's series)",
                engine.metrics_addr)
    return engine
