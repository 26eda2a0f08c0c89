"""docs/nixl.md's tables against the code: every name NIXL's Python modules define (``nixl._api``,
``nixl._bindings``, ``nixl._utils``, telemetry; NIXL's repository snapshot of 2026-08-21, listed
here since CI cannot fetch it) is in a table of docs/nixl.md, and Ferry's module defines it
with NIXL's value where NIXL gives one."""

import re
from pathlib import Path

import pytest

from ferry.nixl import _api, _bindings, _utils

DOC = Path(__file__).resolve().parents[3] / "docs" / "nixl.md"

API_CLASSES = ["nixl_agent", "nixl_agent_config", "nixl_xfer_handle", "nixl_prepped_dlist_handle",
               "nixl_thread_sync_t"]
AGENT_METHODS = [
    "get_plugin_list", "get_plugin_mem_types", "get_plugin_params", "get_backend_mem_types",
    "get_backend_params", "create_backend", "register_memory", "deregister_memory",
    "query_memory", "make_connection", "prep_xfer_dlist", "estimate_xfer_cost",
    "make_prepped_xfer", "initialize_xfer", "transfer", "check_xfer_state",
    "get_xfer_telemetry", "query_xfer_backend", "release_xfer_handle", "release_dlist_handle",
    "prep_mem_view", "release_mem_view", "get_new_notifs", "update_notifs",
    "check_remote_xfer_done", "send_notif", "get_agent_metadata", "get_partial_agent_metadata",
    "add_remote_agent", "remove_remote_agent", "send_local_metadata",
    "send_partial_agent_metadata", "fetch_remote_metadata", "invalidate_local_metadata",
    "check_remote_metadata", "get_xfer_descs", "get_remote_descs", "get_reg_descs",
    "get_serialized_descs", "deserialize_descs"]
CONFIG_ATTRS = ["backends", "enable_pthread", "enable_listen", "port", "capture_telemetry",
                "num_threads", "sync_mode"]
DLIST_METHODS = ["getType", "descCount", "isEmpty", "addDesc", "append", "remDesc", "clear",
                 "print", "__getitem__", "__setitem__"]
BINDING_AGENT = [
    "checkRemoteMD", "createBackend", "createXferReq", "deregisterMem", "estimateXferCost",
    "fetchRemoteMD", "genNotif", "getAvailPlugins", "getBackendParams", "getLocalMD",
    "getLocalPartialMD", "getNotifs", "getPluginParams", "getXferStatus", "getXferTelemetry",
    "invalidateLocalMD", "invalidateRemoteMD", "loadRemoteMD", "makeConnection", "makeXferReq",
    "postXferReq", "prepMemView", "prepXferDlist", "queryMem", "queryXferBackend", "registerMem",
    "releaseMemView", "releaseXferReq", "releasedDlistH", "sendLocalMD", "sendLocalPartialMD"]
AGENT_CONFIG = ["useProgThread", "useListenThread", "listenPort", "syncMode", "pthrDelay",
                "lthrDelay", "captureTelemetry", "etcdWatchTimeout"]
TELEMETRY_FIELDS = ["startTime", "postDuration", "xferDuration", "totalBytes", "descCount"]
ENUMS = {
    "nixl_mem_t": {"DRAM_SEG": 0, "VRAM_SEG": 1, "BLK_SEG": 2, "OBJ_SEG": 3, "FILE_SEG": 4},
    "nixl_xfer_op_t": {"NIXL_READ": 0, "NIXL_WRITE": 1},
    "nixl_status_t": {"NIXL_IN_PROG": 1, "NIXL_SUCCESS": 0, "NIXL_ERR_NOT_POSTED": -1,
                      "NIXL_ERR_INVALID_PARAM": -2, "NIXL_ERR_BACKEND": -3,
                      "NIXL_ERR_NOT_FOUND": -4, "NIXL_ERR_MISMATCH": -5,
                      "NIXL_ERR_NOT_ALLOWED": -6, "NIXL_ERR_REPOST_ACTIVE": -7,
                      "NIXL_ERR_UNKNOWN": -8, "NIXL_ERR_NOT_SUPPORTED": -9},
    "nixl_thread_sync_t": {"NIXL_THREAD_SYNC_NONE": 0, "NIXL_THREAD_SYNC_STRICT": 1,
                           "NIXL_THREAD_SYNC_RW": 2, "NIXL_THREAD_SYNC_DEFAULT": 0},
    "nixl_cost_t": {"NIXL_COST_ANALYTICAL_BACKEND": 0},
}
CONSTANTS = {"NIXL_INIT_AGENT": "", "DEFAULT_COMM_PORT": 8888,
             "HAVE_UCX_GPU_DEVICE_API": False}
ERRORS = ["nixlNotPostedError", "nixlInvalidParamError", "nixlBackendError", "nixlNotFoundError",
          "nixlMismatchError", "nixlNotAllowedError", "nixlRepostActiveError", "nixlUnknownError",
          "nixlNotSupportedError", "nixlRemoteDisconnectError", "nixlCancelledError",
          "nixlNoTelemetryError"]
UTILS = ["malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"]
TELEMETRY_NAMES = [
    "NIXL_TELEMETRY_ENABLE", "NIXL_TELEMETRY_DIR", "NIXL_TELEMETRY_EXPORTER",
    "NIXL_TELEMETRY_PROMETHEUS_PORT", "NIXL_TELEMETRY_PROMETHEUS_LOCAL",
    "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "NIXL_TELEMETRY_ENABLED_METRICS",
    "NIXL_TELEMETRY_BUFFER_SIZE", "NIXL_TELEMETRY_RUN_INTERVAL",
    "agent_tx_bytes_total", "agent_rx_bytes_total", "agent_tx_last_bytes", "agent_rx_last_bytes",
    "agent_tx_requests_num_total", "agent_rx_requests_num_total",
    "agent_memory_registered_total", "agent_memory_deregistered_total",
    "agent_memory_registered_last_bytes", "agent_memory_deregistered_last_bytes",
    "agent_xfer_time_total", "agent_xfer_post_time_total", "agent_xfer_time",
    "agent_xfer_post_time", "agent_xfer_time_us", "agent_xfer_post_time_us",
    "agent_telemetry_events_dropped_total", "agent_errors_total"]


def table_words() -> set[str]:
    """Every identifier inside backticks on a table row of docs/nixl.md."""
    words: set[str] = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("|"):
            for code in re.findall(r"`([^`]+)`", line):
                words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    return words


def every_nixl_name() -> list[str]:
    names = API_CLASSES + AGENT_METHODS + DLIST_METHODS + BINDING_AGENT + AGENT_CONFIG
    names += TELEMETRY_FIELDS + list(ENUMS) + list(CONSTANTS) + ERRORS + UTILS + TELEMETRY_NAMES
    names += ["nixlXferDList", "nixlRegDList", "nixlRemoteDList", "nixlXferTelemetry",
              "nixlAgentConfig", "nixlAgent", "trim", "index", "release"]
    for values in ENUMS.values():
        names += list(values)
    return [n for n in names if not n.startswith("__")]


def test_every_nixl_name_is_in_a_table_of_the_docs():
    missing = [n for n in every_nixl_name() if n not in table_words()]
    assert not missing, f"docs/nixl.md's tables do not name {missing}"


def test_ferry_defines_every_nixl_name_with_nixls_values():
    for name in API_CLASSES:
        assert hasattr(_api, name), name
    for name in AGENT_METHODS:
        assert callable(getattr(_api.nixl_agent, name, None)), name
    config = _api.nixl_agent_config()
    for name in CONFIG_ATTRS:
        assert hasattr(config, name), name
    for cls in ("nixl_xfer_handle", "nixl_prepped_dlist_handle"):
        assert callable(getattr(getattr(_api, cls), "release", None)), cls
    for cls in ("nixlXferDList", "nixlRegDList", "nixlRemoteDList"):
        for name in DLIST_METHODS:
            assert callable(getattr(getattr(_bindings, cls), name, None)), (cls, name)
    for cls in ("nixlXferDList", "nixlRegDList"):
        assert callable(getattr(getattr(_bindings, cls), "index")), cls
    assert callable(getattr(_bindings.nixlRegDList, "trim", None)), "trim"
    for name in BINDING_AGENT:
        assert callable(getattr(_bindings.nixlAgent, name, None)), name
    agent_config = _bindings.nixlAgentConfig()
    for name in AGENT_CONFIG:
        assert hasattr(agent_config, name), name
    telemetry = _bindings.nixlXferTelemetry()
    for name in TELEMETRY_FIELDS:
        assert hasattr(telemetry, name), name
    for enum, values in ENUMS.items():
        for name, value in values.items():
            assert int(getattr(getattr(_bindings, enum), name)) == value, (enum, name)
            assert int(getattr(_bindings, name, value)) == value, name
    for name, value in CONSTANTS.items():
        assert getattr(_bindings, name) == value, name
    for name in ERRORS:
        assert issubclass(getattr(_bindings, name), Exception), name
    for name in UTILS:
        assert callable(getattr(_utils, name)), name


@pytest.mark.parametrize("name", ["nixlRegDList", "nixlAgent"])
def test_a_name_taken_away_is_noticed(monkeypatch, name):
    """The check bites: a class that lost a method fails it."""
    cls = getattr(_bindings, name)
    victim = "trim" if name == "nixlRegDList" else "sendLocalPartialMD"
    monkeypatch.delattr(cls, victim)
    with pytest.raises(AssertionError, match=victim):
        test_ferry_defines_every_nixl_name_with_nixls_values()
