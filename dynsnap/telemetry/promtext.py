"""Prometheus text exposition, read the one way dynsnap reads it: the samples of a few named metrics,
parsed by prometheus_client's parser (the library dynsnap exposes its own metrics with), so that the
controller (a frontend's demand, ``dynamo_frontend_*``) and the agent (a worker's in-flight requests,
``dynamo_component_*``, whose ``worker_id`` label is the instance id in hex) read labels, escapes,
exponents, timestamps, NaN and Inf alike.

- Only the lines of the metrics asked for are parsed: a page of thousands of series costs a scan,
  not a parse (the controller reads every opted-in graph's frontend every scrape interval). A line
  belongs to a metric when it starts with the metric's exact name followed by ``{`` or a blank (so
  ``dynamo_frontend_inflight_requests_total`` is not ``dynamo_frontend_inflight_requests``).
- A line the parser refuses is skipped, not the page: one bad series must not blind the reader to
  the others.
- A value that is NaN, infinite or negative is no count of requests (what both readers count) and is
  left out: a broken exporter must not make a planner divide by infinity or an idle check see a
  worker with -1 requests in flight as idle.

Layer: ``dynsnap.telemetry`` (the only importer of prometheus_client).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def _parse(text: str) -> list[Sample]:
    return [Sample(s.name, float(s.value), dict(s.labels)) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def samples(text: str, names: Iterable[str]) -> list[Sample]:
    """The samples of the metrics ``names`` on a Prometheus text page (see the module docstring)."""
    wanted = frozenset(names)
    prefixes = tuple(n + sep for n in wanted for sep in ("{", " ", "\t"))
    lines = [line for line in text.splitlines() if line.startswith(prefixes)]
    if not lines:
        return []
    try:
        found = _parse("\n".join(lines) + "\n")
    except ValueError:  # one line the parser refuses: the others, each on its own
        found = []
        for line in lines:
            try:
                found += _parse(line + "\n")
            except ValueError:
                continue
    return [s for s in found if s.name in wanted and math.isfinite(s.value) and s.value >= 0]


def total(found: Iterable[Sample], name: str) -> float | None:
    """The sum of ``name``'s samples; None when there is none."""
    values = [s.value for s in found if s.name == name]
    return sum(values) if values else None
