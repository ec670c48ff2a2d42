"""The agent's executor kept running between actions, for ``wake_e2e.py --resident-agent``: what a
node agent is (a process started once, its imports done), where ``dynsnap agent exec`` starts a new
Python for every action and pays its start-up (0.4-0.6 s on the H200) inside the wake's clock.

It runs the same code as ``dynsnap agent exec`` (dynsnap.agent.exec.execute, the node agent's
executor step by step). Settings: one JSON object of AgentSettings fields as its argument. Then one
JSON object per line on stdin, ``{"action": "capture"|"wake", "uid": UID, "entrypoint": PID,
"tier": "suspend"|"engine", "system_url": URL}`` (the URL: where tier engine calls the engine's
routes); for each it prints the steps' JSON lines, as ``exec`` does, and then
``{"resident_done": true|false}``. It ends at the end of its input.

Run: PYTHONPATH=<repository root> python3 bench/e2e/resident_agent.py '{"images_root": ...}'
"""
from __future__ import annotations

import asyncio
import json
import sys

from dynsnap.agent.exec import execute, subject_for
from dynsnap.agent.settings import AgentSettings
from dynsnap.models.protocol import Tier


def main() -> int:
    settings = AgentSettings.model_validate(json.loads(sys.argv[1]))
    loop = asyncio.new_event_loop()
    try:
        for line in sys.stdin:  # bounded by the driver's input: it closes stdin when done
            req = json.loads(line)
            outcome = loop.run_until_complete(execute(
                settings, subject_for(req["uid"], entrypoint=int(req["entrypoint"]), system_url=req.get("system_url")),
                action=req["action"],
                tier=Tier(req.get("tier", "suspend")), quiesced=True, out=sys.stdout))
            print(json.dumps({"resident_done": outcome.ok}), flush=True)
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
