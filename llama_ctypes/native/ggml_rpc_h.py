"""ctypes mirror of ggml's ``ggml-rpc.h`` (the RPC backend: remote workers as devices).

Declarations only. The RPC backend is optional: it is linked into ``libggml`` in a
source build (``-DGGML_RPC=ON``) and is a loadable module in a run-time-dispatched
build (the ``llama-ctypes-rpc`` plugin), so its functions are not bound from a
library file at load like the other prototypes. They are looked up through ggml's
registry, as llama.cpp's own ``rpc-server`` and ``--rpc`` do it:
``ggml_backend_reg_get_proc_address(ggml_backend_reg_by_name("RPC"), name)``, and
called through the function-pointer types below (``PROC_PROTOTYPES``). A build
without RPC has no "RPC" registry entry.

Wire constants of the protocol (from ``ggml/src/ggml-rpc/ggml-rpc.cpp``, not the
header) let Python check that an endpoint answers the handshake before ggml is
asked to connect: ggml aborts the process when it cannot.
"""

from __future__ import annotations

from ctypes import CFUNCTYPE, POINTER, c_bool, c_char_p, c_size_t, c_uint64, c_void_p

# ---- ggml-rpc.h -------------------------------------------------------------------------
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
RPC_PROTO_PATCH_VERSION = 0
GGML_RPC_MAX_SERVERS = 16

# Registry name of the backend (ggml_backend_rpc_reg_get_name); also the backend name of
# every device ggml_backend_rpc_add_server creates.
RPC_REG_NAME = b"RPC"

# GGML_BACKEND_API ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
#   Connects, asks the worker for its devices and returns a registry entry holding them (NULL
#   when it has none, or, patched, when the connection fails; unpatched, ggml aborts then).
#   Cached per endpoint string; the caller registers it with ggml_backend_register.
ggml_backend_rpc_add_server_t = CFUNCTYPE(c_void_p, c_char_p)

# GGML_BACKEND_API void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
#                                                     size_t n_threads, size_t n_devices,
#                                                     ggml_backend_dev_t * devices);
#   Serves clients one at a time, forever; returns only when it cannot start (bad arguments,
#   the address cannot be bound). endpoint is "IPv4-address:port"; cache_dir may be NULL.
ggml_backend_rpc_start_server_t = CFUNCTYPE(None, c_char_p, c_char_p, c_size_t, c_size_t, POINTER(c_void_p))

# ---- connection state (build_scripts/patches/ggml-rpc-connection-errors.patch) -------------------
# Only in libraries built with that patch (a build of this package; not a plain llama.cpp build).
# With it, a connection that fails (the worker died, was stopped, or answered garbage; or it
# could not be made) no longer aborts the process: it is closed and stays failed, every later
# message to it completes at once with its output zeroed, and the caller asks whether it failed.
# One connection per endpoint is shared by everything in the process that uses that worker.
#
# static uint64_t ggml_backend_rpc_connection_id(const char * endpoint);
#   The id of the connection the process uses for endpoint now (unique, never reused), 0 if none.
ggml_backend_rpc_connection_id_t = CFUNCTYPE(c_uint64, c_char_p)
# static uint64_t ggml_backend_rpc_failure_count(void);
#   How many connections have failed in this process so far (only grows).
ggml_backend_rpc_failure_count_t = CFUNCTYPE(c_uint64)
# static bool ggml_backend_rpc_connection_failed(uint64_t id, char * msg, size_t size);
#   Whether connection id failed; its reason is copied to msg (NUL-terminated, cut to size).
ggml_backend_rpc_connection_failed_t = CFUNCTYPE(c_bool, c_uint64, c_char_p, c_size_t)
# static uint64_t ggml_backend_rpc_last_failure(const char * endpoint, char * msg, size_t size);
#   The id of the last connection to endpoint that failed (0: none has); its reason is copied to msg.
ggml_backend_rpc_last_failure_t = CFUNCTYPE(c_uint64, c_char_p, c_char_p, c_size_t)
# static bool ggml_backend_rpc_reset_connection(const char * endpoint);
#   Drops endpoint's connection if it failed, so that the next use connects again (whoever holds
#   the failed one keeps it, failed). A failed connection otherwise stays the endpoint's one.
ggml_backend_rpc_reset_connection_t = CFUNCTYPE(c_bool, c_char_p)
# static bool ggml_backend_rpc_check_connection(const char * endpoint);
#   Exercises endpoint's open connection, if any, with a cheap command (GET_ALIGNMENT of device 0), so
#   that one whose worker went away while it sat idle fails now; connects nothing. Returns whether
#   endpoint's connection is a failed one (now or before); false when none is open.
ggml_backend_rpc_check_connection_t = CFUNCTYPE(c_bool, c_char_p)

# The functions ggml_backend_rpc_get_proc_address hands out, by name.
PROC_PROTOTYPES = {
    "ggml_backend_rpc_add_server": ggml_backend_rpc_add_server_t,
    "ggml_backend_rpc_start_server": ggml_backend_rpc_start_server_t,
    "ggml_backend_rpc_connection_id": ggml_backend_rpc_connection_id_t,
    "ggml_backend_rpc_failure_count": ggml_backend_rpc_failure_count_t,
    "ggml_backend_rpc_connection_failed": ggml_backend_rpc_connection_failed_t,
    "ggml_backend_rpc_last_failure": ggml_backend_rpc_last_failure_t,
    "ggml_backend_rpc_reset_connection": ggml_backend_rpc_reset_connection_t,
    "ggml_backend_rpc_check_connection": ggml_backend_rpc_check_connection_t,
}

# ---- the wire protocol (ggml-rpc.cpp, transport.h) ------------------------------------------
# Request:  | rpc_cmd (1 byte) | request_size (uint64) | request_data |
# Response: | response_size (uint64) | response_data |     (native byte order: little-endian)
RPC_CMD_HELLO = 14  # static_assert(RPC_CMD_HELLO == 14) in ggml-rpc.cpp: stable across versions
RPC_CONN_CAPS_SIZE = 24
# struct rpc_msg_hello_req { uint8_t conn_caps[RPC_CONN_CAPS_SIZE]; }  (zeros: plain TCP)
HELLO_REQUEST_SIZE = RPC_CONN_CAPS_SIZE
# struct rpc_msg_hello_rsp { uint8_t major, minor, patch, padding; uint8_t conn_caps[24]; }
HELLO_RESPONSE_SIZE = 4 + RPC_CONN_CAPS_SIZE

__all__ = [
    "GGML_RPC_MAX_SERVERS",
    "HELLO_REQUEST_SIZE",
    "HELLO_RESPONSE_SIZE",
    "PROC_PROTOTYPES",
    "RPC_CMD_HELLO",
    "RPC_CONN_CAPS_SIZE",
    "RPC_PROTO_MAJOR_VERSION",
    "RPC_PROTO_MINOR_VERSION",
    "RPC_PROTO_PATCH_VERSION",
    "RPC_REG_NAME",
    "ggml_backend_rpc_add_server_t",
    "ggml_backend_rpc_connection_failed_t",
    "ggml_backend_rpc_connection_id_t",
    "ggml_backend_rpc_failure_count_t",
    "ggml_backend_rpc_last_failure_t",
    "ggml_backend_rpc_reset_connection_t",
    "ggml_backend_rpc_start_server_t",
]
