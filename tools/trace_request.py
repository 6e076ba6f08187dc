"""Which of swiftk's source files one served request goes through, two ways (issue 82's "files on the path"):

- **stacks**: the files on the HTTP handler's call stack when it hands the request to the scheduler, and on the
  decode thread's stack when the target pass fetches the fused CPU kernel (``cpu_layers.layers_fn``, right before
  the C call): the path a reader follows from the handler to the kernel;
- **ran**: every file in which any function ran while the request was served (request checks, draft sources,
  acceptance, streaming: everything a round touches).

    python tools/trace_request.py [--model smollm2-135m]

The request is the server's own (FastAPI's test client, in process), after one warm-up request.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import swiftk


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args(argv)
    from fastapi.testclient import TestClient

    root = str(Path(swiftk.__file__).parent)
    stacks: dict = {}
    ran: list = []
    on = [False]

    def files(frame) -> list:
        out = []
        while frame is not None:
            if frame.f_code.co_filename.startswith(root):
                out.append("swiftk" + frame.f_code.co_filename[len(root):])
            frame = frame.f_back
        return list(dict.fromkeys(out[::-1]))

    def prof(frame, event, arg):
        if not on[0] or event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        name = "swiftk" + frame.f_code.co_filename[len(root):]
        if name not in ran:
            ran.append(name)
        if frame.f_code.co_name in ("submit", "layers_fn", "layers_multi_fn"):
            stacks.setdefault(f"{frame.f_code.co_name} ({name})", files(frame))

    sys.setprofile(prof)
    threading.setprofile(prof)   # before the server starts its decode thread
    from swiftk.serve.app import Server

    srv = Server(swiftk.load(a.model, persist=False), "m")
    body = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 8}
    with TestClient(srv.app()) as client:
        client.post("/v1/completions", json=body)
        on[0] = True
        r = client.post("/v1/completions", json=body)
        on[0] = False
    sys.setprofile(None)
    threading.setprofile(None)
    if r.status_code != 200:
        raise SystemExit(f"the request failed: {r.status_code} {r.text[:300]}")
    path = sorted({f for v in stacks.values() for f in v})
    for k, v in stacks.items():
        print(f"{k}: {' -> '.join(v)}")
    print(f"stacks: {len(path)} files: {', '.join(path)}")
    print(f"ran: {len(ran)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
