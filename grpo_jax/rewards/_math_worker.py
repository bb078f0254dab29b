"""Child process of the ``math_verify`` reward: one JSON request per line in, one reply out.

Run as a script (``python _math_worker.py``), so it imports neither grpo_jax nor JAX;
math-verify's SIGALRM timeouts work here because each request runs in the main thread, and
the parent kills this process when a request outlives even those. The request and reply
fields: docs/rewards.md, "The built-in rewards".
"""

import json
import os
import sys
import time

# The script's own folder (grpo_jax/rewards) must not shadow installed packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _parse(parse, text: str, timeout: int):
    parsed = parse(text, parsing_timeout=timeout)
    if not parsed and "$" not in text and "\\(" not in text:
        parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed


def main() -> None:
    proto = sys.stdout
    sys.stdout = sys.stderr  # library prints must not corrupt the protocol
    from math_verify import parse, verify

    proto.write('{"ready": true}\n')
    proto.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req.get("sleep"):
                time.sleep(float(req["sleep"]))
            timeout = max(1, int(req.get("timeout", 5)))
            gold = _parse(parse, req["gold"], timeout)
            if not gold:
                reply = {"value": None}
            else:
                pred = _parse(parse, req["pred"], timeout)
                ok = bool(pred) and verify(gold, pred, timeout_seconds=timeout)
                reply = {"value": 1.0 if ok else 0.0}
        except Exception as e:  # noqa: BLE001 -- reported to the parent, counted there
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
