"""Real servers on loopback for the serving tests: `genrec serve` in a child process, or
uvicorn in a thread of this process; and a faulty writer's files."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from genrec.models.serving.bench import start_server_process

NUM_ITEMS = 300
MAX_SEQ_LEN = 96
TOKEN = "test-reload-token-0123456789abcdef"
LOOP_THREAD = "test-uvicorn-loop"
"""Name of the thread running `serve_in_thread`'s event loop."""


class ServerProcess:
    """`genrec serve` in a child process; its stderr is drained into `lines` (a full pipe
    would block the server)."""

    def __init__(self, artifact: Path, *, extra: list[str], threads: int = 1) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start_server_process(artifact, self.port, threads=threads, extra=extra)
        self.lines: list[str] = []
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    def summary(self) -> str:
        deadline = time.time() + 10
        while time.time() < deadline:
            found = [ln for ln in list(self.lines) if ln.startswith("genrec serve: model")]
            if found:
                return found[0].rstrip("\n")
            time.sleep(0.05)
        raise AssertionError(f"no start-up summary in {self.lines!r}")

    def peak_rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc status")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@contextmanager
def serve_in_thread(app):
    """A real uvicorn server for `app` on a loopback port, in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=LOOP_THREAD, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "in-process server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def rewrite_tensors(root: Path, rel: str, change) -> None:
    """`change` applied to the tensors of file `rel` of an artifact or delta, its checksum in
    the manifest refreshed (a faulty writer, not a damaged file): only the contents' own
    consistency can catch it."""
    from safetensors.torch import load_file, save_file

    from genrec.data.files import sha256_file

    path = root / rel
    save_file({k: v.contiguous() for k, v in change(dict(load_file(str(path)))).items()}, str(path))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (root / "manifest.json").write_text(json.dumps(manifest))
