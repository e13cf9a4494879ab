"""llama.cpp's RPC backend: one model over RPC workers and the local CPU.

Two workers run as separate processes (``python -m llama_ctypes rpc-server``) on
127.0.0.1 for the module. A split run must generate what a purely local run does; an
unreachable or silent endpoint must fail fast with RPCConnectionError; a worker that
dies while a model uses it ends that call with RPCConnectionError, the model and its
contexts refuse further use, and the process goes on (ggml-rpc as patched by
build_scripts/patches; unpatched, ggml aborts the client, shown in a subprocess).
Tests that kill a worker start their own: the module's workers stay up.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import llama_ctypes as lc
from llama_ctypes.core.rpc import client as rpc
from llama_ctypes.core.rpc.endpoints import probe

pytestmark = pytest.mark.skipif(not rpc.rpc_available(), reason="these libraries were built without GGML_RPC")

PROMPT = "Once upon a time, in a small village by the sea,"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """``python -m llama_ctypes rpc-server`` in its own process, output to a log file."""

    def __init__(self, log_dir: Path, *extra: str, host: str = "127.0.0.1", threads: int = 1,
                 port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"{host}:{self.port}"
        self.log = log_dir / f"rpc-worker-{self.port}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_ctypes", "rpc-server", "--host", host, "--port", str(self.port),
                 "--threads", str(threads), *extra],
                stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> "Worker":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"RPC worker exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                probe(self.endpoint, timeout=2.0)
                return self
            except lc.RPCConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"RPC worker {self.endpoint} not ready: {self.log.read_text()[-2000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("rpc")
    started = [Worker(log_dir), Worker(log_dir)]
    try:
        yield [w.wait_ready().endpoint for w in started]
    finally:
        for w in started:
            w.stop()


def local_and_split(path, split_opts: dict, use_extra_bufts: bool = True,
                    **gen) -> tuple[lc.Completion, lc.Completion]:
    with lc.load_model(path, use_extra_bufts=use_extra_bufts) as model:
        local = lc.generate(model, PROMPT, **gen)
    with lc.load_model(path, **split_opts) as model:
        split = lc.generate(model, PROMPT, **gen)
    return local, split


def placement(path, **opts) -> dict[str, int]:
    """Weight bytes per device of a load with these options (llama.cpp's own accounting)."""
    return {d.device: d.model for d in lc.estimate_memory(path, n_ctx=256, **opts).devices if d.model}


# ---- devices ----------------------------------------------------------------------------------
def test_devices_lists_the_workers_with_their_memory(workers):
    added = lc.add_rpc_servers(workers)
    assert [d.endpoint for d in added] == workers
    for d in added:
        assert d.backend == "RPC" and d.type == "gpu" and d.description == d.endpoint
        assert d.memory_total > 0 and 0 < d.memory_free <= d.memory_total
    listed = [d for d in lc.devices() if d.backend == "RPC"]
    assert [d.endpoint for d in listed] == workers
    # gpu_index numbers local GPUs only: registering workers does not renumber them
    assert [d.gpu_index for d in listed] == [None, None]
    lc.add_rpc_servers(",".join(workers))  # idempotent: registered once per endpoint per process
    assert len([d for d in lc.devices() if d.backend == "RPC"]) == 2


# ---- one model over two workers and the local CPU ---------------------------------------------
def test_tiny_model_split_matches_a_local_run(tiny_model_path, workers):
    # 2 layers: layer 0 stays on the CPU (n_gpu_layers=2 offloads layer 1 and the output), layer 1
    # goes to the first worker and the output layer to the second.
    split = dict(rpc_servers=workers, n_gpu_layers=2, tensor_split=[1, 1])
    where = placement(tiny_model_path, **split)
    assert {"RPC0", "RPC1"} <= set(where) and len(where) >= 3, where  # and the CPU ("CPU" or "host")
    local, remote = local_and_split(tiny_model_path, split, max_tokens=48, temp=0, ignore_eos=True)
    assert remote.tokens == local.tokens
    assert len(local.tokens) == 48


@pytest.mark.gemma
def test_gemma_split_matches_a_local_run(gemma_path, workers):
    # 18 layers: 7 on the local CPU, 6 on the first worker, 5 and the output on the second.
    split = dict(rpc_servers=workers, n_gpu_layers=12, tensor_split=[1, 1])
    where = placement(gemma_path, **split)
    assert {"RPC0", "RPC1"} <= set(where) and len(where) >= 3, where
    gen = dict(max_tokens=48, temp=0, ignore_eos=True, logprobs=2)
    # Bit-exact when the local CPU, like a worker, keeps the weights as stored: the transport
    # and the split change nothing.
    local, remote = local_and_split(gemma_path, {**split, "use_extra_bufts": False}, **gen,
                                    use_extra_bufts=False)
    assert remote.tokens == local.tokens
    # With the defaults the local CPU repacks its Q4_K weights (other kernels, other rounding)
    # and a worker does not: greedy may then flip only at a near tie of the local run.
    local, remote = local_and_split(gemma_path, split, **gen)
    if remote.tokens != local.tokens:
        i = next(i for i, (a, b) in enumerate(zip(local.tokens, remote.tokens)) if a != b)
        top = local.logprobs[i].top
        assert top[0].logprob - top[1].logprob < 0.1, (i, local.tokens[i], remote.tokens[i], top)


def test_server_and_manager_take_rpc_servers(tiny_model_path, workers):
    opts = dict(rpc_servers=workers, n_gpu_layers=2, tensor_split=[1, 1], n_ctx=256)
    with lc.load_model(tiny_model_path) as model:
        expected = lc.generate(model, PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens
    with lc.Server(model_path=str(tiny_model_path), n_parallel=1, **opts) as srv:
        assert srv.model.params.rpc_servers == tuple(workers)
        assert srv.generate(PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens == expected
    with lc.ModelManager(memory_budget="auto") as mm:  # this machine's pools; workers' memory is theirs
        info = mm.load("tiny", str(tiny_model_path), n_parallel=1, **opts)
        assert {"RPC0", "RPC1"} <= set(info.placement), info.placement
        assert {("rpc", w) for w in workers} <= set(info.estimated), info.estimated
        assert mm.generate("tiny", PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens == expected


def test_a_model_without_rpc_servers_stays_local(tiny_model_path, workers):
    lc.add_rpc_servers(workers)  # registered in this process...
    where = placement(tiny_model_path)  # ...but not asked for: llama.cpp must not use them
    assert not any(k.startswith("RPC") for k in where), where


# ---- failures -----------------------------------------------------------------------------------
def test_an_unreachable_endpoint_fails_fast_and_the_process_stays_usable(tiny_model_path, tiny_model):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(lc.RPCConnectionError, match=dead.replace(".", r"\.")) as err:
        lc.load_model(tiny_model_path, rpc_servers=[dead], n_gpu_layers=2)
    assert time.monotonic() - t0 < 5
    assert "timeout 3 s" in str(err.value) and err.value.endpoint == dead
    assert isinstance(err.value, ConnectionError) and dead not in rpc.registered_endpoints()
    assert lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0).tokens  # still usable


def test_an_endpoint_that_never_answers_times_out(tiny_model_path):
    # Accepts connections (the kernel's backlog does) but never answers the handshake, like a
    # worker busy with another client or a port that is not an RPC worker.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(lc.RPCConnectionError, match="within the 3 s timeout"):
            lc.load_model(tiny_model_path, rpc_servers=[endpoint])
        assert time.monotonic() - t0 < 5


def test_bad_endpoints_are_rejected_before_any_connection():
    for bad in (["localhost"], ["::1:50052"], ["h:0"], ["h:70000"], "h:1", ["h:1", "h:01"]):
        with pytest.raises(lc.InvalidArgumentError):
            lc.ModelParams(rpc_servers=bad)
    assert lc.ModelParams(rpc_servers=["h:050052"]).rpc_servers == ("h:50052",)


def test_a_build_without_rpc_says_how_to_get_it(tiny_model_path, monkeypatch):
    lib = lc.init()
    monkeypatch.setattr(lib, "ggml_backend_reg_by_name", lambda name: None)
    with pytest.raises(lc.NativeLibraryError, match="llama-ctypes-rpc"):
        lc.load_model(tiny_model_path, rpc_servers=["127.0.0.1:1"])


_CLIENT = textwrap.dedent("""
    import sys
    import llama_ctypes as lc
    model = lc.load_model(sys.argv[1], rpc_servers=[sys.argv[2]], n_gpu_layers=2, tensor_split=[1])
    first = True
    try:
        while True:
            for piece in lc.stream(model, "Once upon a time", max_tokens=64, temp=0, ignore_eos=True, n_ctx=256):
                if first:
                    print("generating", flush=True)
                    first = False
    except lc.RPCConnectionError as exc:
        print("lost", exc.endpoint, flush=True)
    model.close()
    print("closed", flush=True)
""")

needs_connection_errors = pytest.mark.skipif(
    not rpc.connection_errors_supported(),
    reason="ggml-rpc built without build_scripts/patches: a lost worker aborts the client")


def test_a_worker_killed_mid_generation_in_a_subprocess(tiny_model_path, tiny_model, tmp_path):
    # The same in a child process first: with unpatched ggml-rpc the client aborts (SIGABRT,
    # RPC_STATUS_ASSERT), which no test in this process could survive. Its own worker: a
    # worker serves one client at a time, and this process may hold the module's workers.
    worker = Worker(tmp_path).wait_ready()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, str(tiny_model_path), worker.endpoint],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "GGML_NO_BACKTRACE": "1"})  # (no gdb backtrace)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(client.stdout.readline()), daemon=True).start()
        try:
            assert lines.get(timeout=120) == "generating\n", client.stderr.read()
        except queue.Empty:
            pytest.fail("the client never started generating")
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        out, err = client.communicate(timeout=60)
        if rpc.connection_errors_supported():
            assert client.returncode == 0, (client.returncode, err[-2000:])
            assert out.splitlines() == [f"lost {worker.endpoint}", "closed"], (out, err[-2000:])
        else:
            assert client.returncode != 0
            if os.name == "posix":
                assert client.returncode == -signal.SIGABRT, (client.returncode, err[-2000:])
            assert "Remote RPC server crashed" in err, err[-2000:]  # ggml's RPC_STATUS_ASSERT message
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        worker.stop()
    assert lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0).tokens  # this process is fine


def kill(worker: Worker) -> None:
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(10)


def assert_lost(err, endpoint: str) -> None:
    assert err.value.endpoint == endpoint and isinstance(err.value, ConnectionError)
    assert f"RPC worker {endpoint} was lost" in str(err.value), str(err.value)


@needs_connection_errors
def test_a_worker_killed_mid_generation_raises_and_the_process_stays_usable(tiny_model_path, tiny_model, tmp_path):
    a, b = Worker(tmp_path), Worker(tmp_path)
    try:
        a.wait_ready(), b.wait_ready()
        expected = lc.generate(tiny_model, PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens
        model = lc.load_model(tiny_model_path, rpc_servers=[a.endpoint, b.endpoint], n_gpu_layers=2,
                              tensor_split=[1, 1])
        pieces = 0
        with pytest.raises(lc.RPCConnectionError) as err:
            for _ in lc.stream(model, PROMPT, max_tokens=200, temp=0, ignore_eos=True, n_ctx=256):
                pieces += 1
                if pieces == 3:
                    kill(a)
        assert pieces == 3  # the next decode noticed
        assert_lost(err, a.endpoint)
        # The model and its contexts refuse further use, with the same error.
        with pytest.raises(lc.RPCConnectionError, match="was lost"):
            model.check_workers()
        with pytest.raises(lc.RPCConnectionError, match="was lost"):
            lc.generate(model, PROMPT, max_tokens=4)
        with pytest.raises(lc.RPCConnectionError, match="was lost"):
            lc.Context.create(model, n_ctx=256)
        # The process goes on: local models, and a new model over the surviving worker.
        assert lc.generate(tiny_model, PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens == expected
        with lc.load_model(tiny_model_path, rpc_servers=[b.endpoint], n_gpu_layers=2, tensor_split=[1]) as other:
            assert lc.generate(other, PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens == expected
            # Freeing the lost model: its buffers on the dead worker are dropped without the network,
            # those on the surviving one freed over the connection the new model shares.
            t0 = time.monotonic()
            model.close()
            assert model.freed and time.monotonic() - t0 < 5
            assert lc.generate(other, PROMPT, max_tokens=16, temp=0, ignore_eos=True).tokens == expected
        with pytest.raises(lc.RPCConnectionError, match="cannot reach"):  # the dead one: probed first
            lc.load_model(tiny_model_path, rpc_servers=[a.endpoint], n_gpu_layers=2)
        listed = {d.endpoint: d for d in lc.devices() if d.backend == "RPC"}
        assert listed[a.endpoint].memory_total == 0 and listed[b.endpoint].memory_total > 0
    finally:
        a.stop(), b.stop()


@needs_connection_errors
def test_a_worker_killed_between_two_requests(tiny_model_path, tiny_model, tmp_path):
    worker = Worker(tmp_path).wait_ready()
    port = worker.port
    try:
        expected = lc.generate(tiny_model, PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens
        model = lc.load_model(tiny_model_path, rpc_servers=[worker.endpoint], n_gpu_layers=2, tensor_split=[1])
        ctx = lc.Context.create(model, n_ctx=256)
        assert lc.generate(model, PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens == expected
        kill(worker)
        with pytest.raises(lc.RPCConnectionError) as err:
            lc.generate(model, PROMPT, max_tokens=8, temp=0, ignore_eos=True)
        assert_lost(err, worker.endpoint)
        with pytest.raises(lc.RPCConnectionError, match="was lost"):  # a context made before: refused too
            ctx.lease()
        # A worker back on the same port: a new model connects afresh while the lost one is still
        # open (it keeps its failed connection); freeing the lost one later leaves the new one alone.
        worker = Worker(tmp_path, port=port).wait_ready()
        with lc.load_model(tiny_model_path, rpc_servers=[worker.endpoint], n_gpu_layers=2,
                           tensor_split=[1]) as again:
            assert lc.generate(again, PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens == expected
            ctx.close()
            model.close()
            assert model.freed
            assert lc.generate(again, PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens == expected
    finally:
        worker.stop()


def test_a_projector_never_goes_to_an_rpc_worker(tiny_model_path, tmp_path):
    """clip takes the first GPU-type device when none is named, and a registered RPC worker's is one: with
    that worker gone, loading any mmproj ended the process (GGML_ASSERT(buffer) in clip's load)."""
    from tiny_models import write_tiny_mmproj

    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf")
    worker = Worker(tmp_path).wait_ready()
    try:
        with lc.load_model(tiny_model_path, rpc_servers=[worker.endpoint], n_gpu_layers=2, tensor_split=[1]):
            pass
        kill(worker)
        with lc.load_model(tiny_model_path, mmproj=mmproj) as model:  # (a local model, after the loss)
            assert model.projector is not None and "vision" in model.projector.modalities
    finally:
        worker.stop()


@needs_connection_errors
def test_a_server_whose_worker_dies_fails_its_requests_and_stops(tiny_model_path, tiny_model, tmp_path):
    worker = Worker(tmp_path).wait_ready()
    try:
        expected = lc.generate(tiny_model, PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens
        srv = lc.Server(model_path=str(tiny_model_path), rpc_servers=[worker.endpoint], n_gpu_layers=2,
                        tensor_split=[1], n_parallel=2, n_ctx=512)
        assert srv.generate(PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens == expected
        kill(worker)  # between two requests: the next decode finds the connection gone
        with pytest.raises(lc.RPCConnectionError) as err:
            srv.generate(PROMPT, max_tokens=8, temp=0, ignore_eos=True)
        assert_lost(err, worker.endpoint)
        with pytest.raises(lc.ServerClosedError, match="was lost"):  # the server stopped
            srv.generate(PROMPT, max_tokens=4)
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < 10
        assert lc.generate(tiny_model, PROMPT, max_tokens=8, temp=0, ignore_eos=True).tokens == expected
    finally:
        worker.stop()


# ---- a connection lost at a chosen message (a proxy between this process and a worker) ---------
_CMDS = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
         "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
         "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR")


class Proxy:
    """A TCP proxy to a worker that reads the client's ggml RPC requests and can cut every connection.

    ``cut_at(cmd, nth, delay)``: at the ``nth`` request ``cmd`` from now, wait ``delay`` seconds, then
    close both sides of every connection (as a worker that died would; the worker itself lives on and
    serves the next connection, as one restarted would). ``cut()``: the same, now.
    """

    def __init__(self, port: int):
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen: list[str] = []
        self._rule: tuple[str, int, float] | None = None
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at(self, cmd: str, nth: int = 1, delay: float = 0.0) -> None:
        with self._lock:
            self._rule = (cmd, self.seen.count(cmd) + nth, delay)

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client), daemon=True).start()

    @staticmethod
    def _recv(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _answers(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(65536):
                client.sendall(data)
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                head = self._recv(client, 9)
                body = self._recv(client, struct.unpack("<Q", head[1:])[0])
                cmd = _CMDS[head[0]] if head[0] < len(_CMDS) else str(head[0])
                with self._lock:
                    self.seen.append(cmd)
                    rule = self._rule
                    hit = rule is not None and rule[0] == cmd and rule[1] == self.seen.count(cmd)
                    if hit:
                        self._rule = None
                if hit:
                    time.sleep(rule[2])
                    self.cut()
                    return
                server.sendall(head + body)
        except (OSError, EOFError):
            pass
        try:
            server.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.fixture(scope="module")
def spare_worker(tmp_path_factory):
    """A worker of its own for the proxy tests (the proxy cuts connections; the worker lives on)."""
    worker = Worker(tmp_path_factory.mktemp("rpc-spare")).wait_ready()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def proxy(spare_worker):
    p = Proxy(spare_worker.port)
    try:
        yield p
    finally:
        p.close()


ON_WORKER = dict(n_gpu_layers=99, tensor_split=[1])  # every layer and the output on the worker


@needs_connection_errors
def test_a_worker_lost_while_a_decode_finishes_is_never_read_as_a_result(tiny_model_path, tiny_model, proxy):
    # llama_decode returns before the worker has computed and sent back the outputs (ggml runs the
    # graph and reads the outputs back asynchronously). The connection is cut after llama_decode
    # returned: the outputs must not be read as a result (a failed connection answers zeros,
    # token 0), the decode raises.
    expected = lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens
    with lc.load_model(tiny_model_path, rpc_servers=[proxy.endpoint], **ON_WORKER) as model:
        assert lc.generate(model, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
        proxy.cut_at("GET_TENSOR", delay=0.3)  # (the first decode's logits, read back)
        with pytest.raises(lc.RPCConnectionError) as err:
            lc.generate(model, PROMPT, max_tokens=1, temp=0)
        assert_lost(err, proxy.endpoint)
        assert "GET_TENSOR" in str(err.value)
    # Through the lease: the decode itself raises, before any output is read.
    with lc.load_model(tiny_model_path, rpc_servers=[proxy.endpoint], **ON_WORKER) as model:
        ctx = lc.Context.create(model, n_ctx=256)
        from llama_ctypes.core.batch import Batch
        batch = Batch(64)
        batch.add_sequence(model.tokenize(PROMPT), 0, 0)
        with ctx.lease() as lease:
            lease.decode(batch)
            assert int(lease.logits(-1).argmax()) == expected[0]
            proxy.cut_at("GET_TENSOR", delay=0.3)
            lease.clear()
            with pytest.raises(lc.RPCConnectionError, match="was lost"):
                lease.decode(batch)
        ctx.close()
    # A Server: the tick's request fails with the error (it does not complete with token 0).
    with lc.Server(model_path=str(tiny_model_path), rpc_servers=[proxy.endpoint], n_parallel=2, n_ctx=512,
                   **ON_WORKER) as srv:
        assert srv.generate(PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
        proxy.cut_at("GET_TENSOR", delay=0.3)
        with pytest.raises(lc.RPCConnectionError) as err:
            srv.generate("The quick brown fox", max_tokens=1, temp=0)
        assert_lost(err, proxy.endpoint)
        with pytest.raises(lc.ServerClosedError, match="was lost"):
            srv.generate(PROMPT, max_tokens=1)


@needs_connection_errors
@pytest.mark.parametrize("cmd, nth", [("HELLO", 2), ("GET_ALIGNMENT", 1), ("GET_MAX_SIZE", 1)])
def test_a_connection_lost_once_during_a_load_fails_that_load_only(tiny_model_path, tiny_model, proxy, cmd, nth):
    # The load's connection fails while llama.cpp asks for the worker's buffer type (its handshake,
    # alignment, largest buffer) and the worker is reachable again right after. The load fails
    # with RPCConnectionError (nothing reconnects behind it, nothing is allocated from the failed
    # connection's stand-in answers: that aborted the process in ggml-alloc), the next load works.
    lc.add_rpc_servers([proxy.endpoint])
    proxy.cut_at(cmd, nth)  # HELLO: the 1st is the load's probe, the 2nd the load's own connection
    with pytest.raises(lc.RPCConnectionError) as err:
        lc.load_model(tiny_model_path, rpc_servers=[proxy.endpoint], **ON_WORKER)
    assert_lost(err, proxy.endpoint)
    expected = lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens
    with lc.load_model(tiny_model_path, rpc_servers=[proxy.endpoint], **ON_WORKER) as model:
        assert lc.generate(model, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected


@needs_connection_errors
def test_a_new_load_after_an_idle_models_worker_came_back(tiny_model_path, tiny_model, proxy):
    # Model A sits idle while its worker goes away and comes back on the same address (the proxy
    # closes every connection: the worker serves the next one). Nothing noticed yet: A's connection
    # is not failed. A new load must find that connection dead and connect afresh, not fail with
    # "was lost" on it; A learns it at its next use.
    expected = lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens
    a = lc.load_model(tiny_model_path, rpc_servers=[proxy.endpoint], **ON_WORKER)
    try:
        assert lc.generate(a, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
        proxy.cut()
        time.sleep(0.2)  # (the connection's end reaches this side)
        with lc.load_model(tiny_model_path, rpc_servers=[proxy.endpoint], **ON_WORKER) as b:
            assert lc.generate(b, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
            with pytest.raises(lc.RPCConnectionError) as err:
                lc.generate(a, PROMPT, max_tokens=4, temp=0)
            assert_lost(err, proxy.endpoint)
            with pytest.raises(lc.RPCConnectionError, match="was lost"):
                a.check_workers()
            a.close()
            assert lc.generate(b, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
    finally:
        a.close()


@needs_connection_errors
def test_a_manager_model_that_lost_its_worker_is_failed_and_can_be_loaded_again(tiny_model_path, tiny_model,
                                                                                proxy):
    from starlette.testclient import TestClient

    from llama_ctypes.interfaces.http import create_app

    expected = lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens
    opts = dict(rpc_servers=[proxy.endpoint], n_parallel=1, n_ctx=256, **ON_WORKER)
    with lc.ModelManager() as mm, TestClient(create_app(mm)) as http:
        mm.load("m", str(tiny_model_path), **opts)
        used = mm.used()
        assert mm.generate("m", PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
        assert http.get("/health").status_code == 200
        proxy.cut()
        # the request that notices: 503 with the reason (not an internal error)
        answer = http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4})
        assert answer.status_code == 503 and "was lost" in answer.json()["error"]["message"], answer.text
        (info,) = mm.list()
        assert info.status == "failed" and "was lost" in info.error
        assert not mm.loaded("m") and mm.used() == used  # still held until unloaded or loaded again
        with pytest.raises(lc.ModelNotReadyError, match="was lost"):
            mm.generate("m", PROMPT, max_tokens=4)
        health = http.get("/health")
        assert health.status_code == 503 and "m" in health.json()["error"]["message"]
        mm.load("m", str(tiny_model_path), **opts)  # frees the lost one first
        assert mm.loaded("m") and mm.used() == used
        assert mm.generate("m", PROMPT, max_tokens=4, temp=0, ignore_eos=True).tokens == expected
        assert http.get("/health").status_code == 200


# ---- the worker command --------------------------------------------------------------------------
def test_worker_warns_when_listening_beyond_localhost(tmp_path):
    # 127.0.0.2 is loopback (not exposed) but not 127.0.0.1: the warning must show.
    worker = Worker(tmp_path, host="127.0.0.2")
    try:
        deadline = time.monotonic() + 60
        while "no authentication" not in worker.log.read_text():
            if worker.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(worker.log.read_text()[-2000:])
            time.sleep(0.2)
    finally:
        worker.stop()


def test_worker_on_a_busy_port_says_so(workers):
    port = workers[0].rsplit(":", 1)[1]
    out = subprocess.run([sys.executable, "-m", "llama_ctypes", "rpc-server", "--port", port],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_serve_takes_rpc_workers_and_fails_fast_on_a_dead_one(tiny_model_path, workers):
    port = free_port()
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llama_ctypes", "serve", str(tiny_model_path), "--port", str(port),
                           "--rpc", dead, "-ts", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and dead in proc.stderr
    assert time.monotonic() - t0 < 60
    bad = subprocess.run([sys.executable, "-m", "llama_ctypes", "serve", str(tiny_model_path), "--port", str(port),
                          "-ts", "1,x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--tensor-split" in bad.stderr
