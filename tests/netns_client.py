"""The notebook's side of a multi-host test, run on a simulated host (tests/netns.py ``Client``).

Reads (code, values) frames from stdin, runs each in one persistent namespace (so a cluster
attached by one call is there for the next) and writes back ("ok", result) or ("error",
traceback). Its own prints go to stderr; stdout carries only the frames.
"""

from __future__ import annotations

import pickle
import struct
import sys
import traceback


def main() -> None:
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr
    env: dict = {"__name__": "__netns_client__"}
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        code, values = pickle.loads(inp.read(struct.unpack("!I", head)[0]))
        env.update(values)
        env.pop("result", None)
        try:
            exec(compile(code, "<test>", "exec"), env)
            reply = ("ok", env.get("result"))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            blob = pickle.dumps(reply)
        except Exception as exc:
            blob = pickle.dumps(("error", f"the result cannot be pickled: {exc}"))
        out.write(struct.pack("!I", len(blob)) + blob)
        out.flush()


if __name__ == "__main__":
    main()
