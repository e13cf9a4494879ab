"""A small MCP server on stdio (NDJSON JSON-RPC 2.0) for tests/test_http_tools_mcp.py.

Flags pick a behaviour for the whole process:
  --silent          read stdin forever, answer nothing (not even initialize)
  --empty           advertise no tools
  --paged           split tools/list over two pages (nextCursor)
  --startup-noise   print garbage, a 9 MiB line and a non-object before anything else
  --grandchild F    spawn a sleeping grandchild that inherits our pipes; write its pid to F
  --crash-at-start  exit(3) right away

Tools (see call()): echo, add, fail_once, sleep (answered on a thread, so later requests overtake
it), crash (reply, then exit), die (exit without a reply), env, cwd, argv, pid, is_error,
rpc_error, notify (notifications, a server->client ping and a stale reply before the answer),
burst (notification and answer in one write), noise (garbage and a 9 MiB line before the answer),
big (a 1 MiB answer), pings (how many of our pings the client answered), params (echoes arguments),
flood (``mb`` MiB of ``line``-byte stderr lines, then "flood done" on stderr, then the answer),
notify_flood (``count`` notifications in one go before the answer).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

OUT = sys.stdout.buffer
LOCK = threading.Lock()
STATE = {"fail_once": True, "pings_answered": 0}
HUGE = 9 * 1024 * 1024


def send(obj=None, raw=None):
    data = raw if raw is not None else (json.dumps(obj) + "\n").encode()
    with LOCK:
        OUT.write(data)
        OUT.flush()


def text(req_id, s):
    return {"jsonrpc": "2.0", "id": req_id, "result": {"content": [{"type": "text", "text": s}]}}


def schema(**props):
    return {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}


TOOLS = [
    {"name": "echo", "description": "Echo back the input message", "inputSchema": schema(message="string")},
    {"name": "add", "description": "Add two numbers", "inputSchema": schema(a="number", b="number")},
    {"name": "fail_once", "description": "Fails on the first call", "inputSchema": schema()},
    {"name": "sleep", "description": "Sleep, then answer", "inputSchema": schema(seconds="number")},
    {"name": "crash", "description": "Answer, then exit", "inputSchema": schema()},
    {"name": "die", "description": "Exit without answering", "inputSchema": schema()},
    {"name": "env", "description": "An environment variable", "inputSchema": schema(name="string")},
    {"name": "cwd", "description": "The working directory", "inputSchema": schema()},
    {"name": "argv", "description": "Our arguments", "inputSchema": schema()},
    {"name": "pid", "description": "Our pid"},  # no inputSchema: parameters must come out as {}
    {"name": "is_error", "description": "An isError result", "inputSchema": schema()},
    {"name": "rpc_error", "description": "A JSON-RPC error", "inputSchema": schema()},
    {"name": "notify", "description": "Notifications first", "inputSchema": schema(message="string")},
    {"name": "burst", "description": "Notification and answer in one write", "inputSchema": schema()},
    {"name": "noise", "description": "Garbage before the answer", "inputSchema": schema()},
    {"name": "big", "description": "A 1 MiB answer", "inputSchema": schema()},
    {"name": "pings", "description": "Pings the client answered", "inputSchema": schema()},
    {"name": "params", "description": "Echo the arguments", "inputSchema": schema()},
    {"name": "flood", "description": "Spam stderr, then answer", "inputSchema": schema(mb="number", line="number")},
    {"name": "notify_flood", "description": "Spam notifications, then answer", "inputSchema": schema(count="number")},
    {"name": "once", "description": "Named to collide: server e_fail + once = e + fail_once"},
]


def call(req_id, name, args):
    if name == "echo":
        return text(req_id, f"echo: {args.get('message', '')}")
    if name == "add":
        return text(req_id, str(args.get("a", 0) + args.get("b", 0)))
    if name == "fail_once":
        if STATE["fail_once"]:
            STATE["fail_once"] = False
            return {"jsonrpc": "2.0", "id": req_id, "error": {"code": -32000, "message": "transient error"}}
        return text(req_id, "ok")
    if name == "sleep":
        def later():
            time.sleep(float(args.get("seconds", 1)))
            send(text(req_id, "slept"))
        threading.Thread(target=later, daemon=True).start()
        return None
    if name == "crash":
        send(text(req_id, "crashing"))
        os._exit(1)
    if name == "die":
        os._exit(2)
    if name == "env":
        return text(req_id, os.environ.get(args.get("name", ""), "<unset>"))
    if name == "cwd":
        return text(req_id, os.getcwd())
    if name == "argv":
        return text(req_id, json.dumps(sys.argv[1:]))
    if name == "pid":
        return text(req_id, str(os.getpid()))
    if name == "is_error":
        return {"jsonrpc": "2.0", "id": req_id,
                "result": {"isError": True, "content": [{"type": "text", "text": "bad input"},
                                                        {"type": "image", "data": "x"},
                                                        {"type": "text", "text": "second"}]}}
    if name == "rpc_error":
        return {"jsonrpc": "2.0", "id": req_id, "error": {"code": -32602, "message": "no good"}}
    if name == "notify":
        send({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1, "total": 2}})
        send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "hi"}})
        send({"jsonrpc": "2.0", "id": "srv-ping", "method": "ping"})
        send({"jsonrpc": "2.0", "id": 999999, "result": {"content": [{"type": "text", "text": "stale"}]}})
        send({"jsonrpc": "2.0", "id": True, "result": {"content": [{"type": "text", "text": "bool id"}]}})
        return text(req_id, f"echo: {args.get('message', '')}")
    if name == "burst":
        notif = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 50}}
        send(raw=(json.dumps(notif) + "\r\n" + json.dumps(text(req_id, "burst ok")) + "\n").encode())
        return None
    if name == "noise":
        send(raw=b"THIS IS NOT JSON\n\n   \n[1, 2, 3]\n\"str\"\n\xff\xfe\n{\"jsonrpc\": \"2.0\", \"id\":")
        send(raw=b"\n" + b"x" * HUGE + b"\n")
        return text(req_id, "after noise")
    if name == "big":
        return text(req_id, "y" * (1024 * 1024))
    if name == "pings":
        return text(req_id, str(STATE["pings_answered"]))
    if name == "once":
        return text(req_id, "once")
    if name == "flood":
        line = max(1, int(args.get("line", 2)))
        block = (b"e" * (line - 1) + b"\n") * max(1, (1 << 20) // line)
        for _ in range(int(args.get("mb", 1) * (1 << 20)) // len(block)):
            sys.stderr.buffer.write(block)
        sys.stderr.buffer.write(b"flood done\n")
        sys.stderr.buffer.flush()
        return text(req_id, "flooded")
    if name == "notify_flood":
        notif = (json.dumps({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"p": 1}}) + "\n")
        send(raw=notif.encode() * int(args.get("count", 1)))
        return text(req_id, "notified")
    if name == "params":
        return text(req_id, json.dumps(args, sort_keys=True))
    return {"jsonrpc": "2.0", "id": req_id, "error": {"code": -32602, "message": f"Unknown tool: {name}"}}


def main():
    ap = argparse.ArgumentParser()
    for flag in ("--silent", "--empty", "--paged", "--startup-noise", "--crash-at-start"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--grandchild")
    opts, _ = ap.parse_known_args()
    if opts.crash_at_start:
        sys.exit(3)
    if opts.grandchild:
        gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(opts.grandchild, "w") as f:
            f.write(str(gc.pid))
    if opts.startup_noise:
        send(raw=b"garbage at startup\n" + b"z" * HUGE + b"\n42\n")
    print("fake MCP server starting", file=sys.stderr, flush=True)
    tools = [] if opts.empty else TOOLS
    for line in sys.stdin.buffer:
        if opts.silent:
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        method, req_id, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
        if method is None:  # an answer to our ping
            STATE["pings_answered"] += msg.get("id") == "srv-ping" and msg.get("result") == {}
            continue
        if req_id is None:
            continue  # a notification
        if method == "initialize":
            reply = {"jsonrpc": "2.0", "id": req_id, "result": {
                "protocolVersion": "2024-11-05", "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake", "version": "1.0"}}}
        elif method == "tools/list":
            if opts.paged and not params.get("cursor"):
                reply = {"jsonrpc": "2.0", "id": req_id, "result": {"tools": tools[:3], "nextCursor": "p2"}}
            else:
                reply = {"jsonrpc": "2.0", "id": req_id, "result": {"tools": tools[3:] if opts.paged else tools}}
        elif method == "tools/call":
            reply = call(req_id, params.get("name"), params.get("arguments") or {})
        else:
            reply = {"jsonrpc": "2.0", "id": req_id, "error": {"code": -32601, "message": "Method not found"}}
        if reply is not None:
            send(reply)


if __name__ == "__main__":
    main()
