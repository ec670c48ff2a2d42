"""The API server's audit log read back as the watches each pod opened: what Dynamo's pods ask of the
API server at Metadata level (the URL, who, when; no bodies), one event when a response starts and one
when it is complete, so for a watch when the server opened the stream and when it ended it. The
session's cluster (conftest.py) keeps one for the real node's Dynamo pods (their service accounts'
group).

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


def audit_policy(*, users: list[str] | None = None, groups: list[str] | None = None,
                 verbs: list[str] | None = None) -> str:
    """A policy that logs the requests of ``users`` or ``groups`` (``verbs`` only, if given) at Metadata
    level, without the RequestReceived stage, and nothing else."""
    who = (f"  users: {json.dumps(users)}\n" if users else "") + (f"  userGroups: {json.dumps(groups)}\n"
                                                                 if groups else "")
    return ("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
            f"- level: Metadata\n{who}" + (f"  verbs: {json.dumps(verbs)}\n" if verbs else "") + "- level: None\n")


@dataclass(frozen=True)
class Watch:
    """One watch request as the API server audited it."""

    audit_id: str
    resource: str  # e.g. endpointslices, dynamoworkermetadatas
    uri: str
    started: datetime  # the server opened the stream (ResponseStarted)
    ended: datetime | None  # the server ended it (ResponseComplete); None while it is open

    @property
    def timeout_seconds(self) -> int | None:
        """The ``timeoutSeconds`` the client asked for (the server ends the stream after it)."""
        values = parse_qs(urlsplit(self.uri).query).get("timeoutSeconds")
        return int(values[0]) if values else None

    @property
    def ends_by(self) -> datetime | None:
        t = self.timeout_seconds
        return self.started + timedelta(seconds=t) if t is not None else None


@dataclass(frozen=True)
class AuditLog:
    path: Path

    def events(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def watches(self, source_ip: str, *, since: datetime | None = None) -> list[Watch]:
        """Every watch request from ``source_ip`` (a pod's IP) that started after ``since``, oldest first.
        The streams an API server closed as it stopped get no ResponseComplete: ask for the watches
        since the running server started (ControlPlane.apiserver_started) to leave those out."""
        started: dict[str, dict[str, Any]] = {}
        ended: dict[str, datetime] = {}
        for e in self.events():
            if e.get("verb") != "watch" or source_ip not in (e.get("sourceIPs") or []):
                continue
            if e["stage"] == "ResponseStarted":
                started[e["auditID"]] = e
            elif e["stage"] == "ResponseComplete":
                ended[e["auditID"]] = datetime.fromisoformat(e["stageTimestamp"])
        out = [Watch(audit_id=aid, resource=(e.get("objectRef") or {}).get("resource", ""), uri=e["requestURI"],
                     started=datetime.fromisoformat(e["stageTimestamp"]), ended=ended.get(aid))
               for aid, e in started.items()]
        return sorted((w for w in out if since is None or w.started > since), key=lambda w: w.started)
