"""The snapshot preflight's capability check (``worker.capabilities_beyond``, ``runtime.caps``): a worker
process holding, in any set, a capability the agent does not hold is named with it (CRIU, the agent's
child, could not give it back at the restore); what cannot be read counts as everything; a process gone
since the look counts as nothing. Real ``/proc`` for the agent's own sets in one case, a copy otherwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dynsnap.agent import capture_steps as CS
from dynsnap.agent.steps import StepFailure
from dynsnap.agent.worker import WorkerProcs, capabilities_beyond
from dynsnap.models.ids import HostPid, PodUID
from dynsnap.models.protocol import PERMANENT_REFUSALS, Reason
from dynsnap.runtime import caps
from dynsnap.runtime.procfs import ProcStatus

DEFAULT = (1 << 0) | (1 << 1) | (1 << 5)  # CHOWN, DAC_OVERRIDE, KILL
SYS_TIME = 1 << 25


def _status(proc: Path, pid: str, *, inh: int = 0, prm: int = 0, eff: int = 0, bnd: int = 0, amb: int = 0,
            extra: str = "") -> None:
    d = proc / pid
    d.mkdir(parents=True, exist_ok=True)
    ns = pid if pid.isdigit() else "1"
    (d / "status").write_text(f"Name:\tw\nState:\tS (sleeping)\nPPid:\t1\nNSpid:\t{ns}\t{ns}\n"
                              f"CapInh:\t{inh:016x}\nCapPrm:\t{prm:016x}\nCapEff:\t{eff:016x}\n"
                              f"CapBnd:\t{bnd:016x}\nCapAmb:\t{amb:016x}\n{extra}")


def _worker(proc: Path, *pids: int) -> WorkerProcs:
    procs = tuple(ProcStatus(pid=HostPid(p), ppid=HostPid(1), nspid=(p, 10000 + i), state="S", name="w")
                  for i, p in enumerate(pids))
    return WorkerProcs(pod_uid=PodUID("u"), entrypoint=HostPid(1), pidns=1, control_dir="/run/dynsnap", info={},
                       procs=procs, gpu=(), proc=proc)


def test_names_and_sets_read_the_status_file(tmp_path: Path) -> None:
    assert caps.names(DEFAULT | SYS_TIME) == ["CHOWN", "DAC_OVERRIDE", "KILL", "SYS_TIME"]
    assert caps.names(1 << 40) == ["CHECKPOINT_RESTORE"] and caps.names(1 << 45) == ["cap45"]
    _status(tmp_path, "7", prm=DEFAULT, bnd=DEFAULT | SYS_TIME)
    assert caps.sets(7, tmp_path) == {"CapInh": 0, "CapPrm": DEFAULT, "CapEff": 0, "CapBnd": DEFAULT | SYS_TIME,
                                      "CapAmb": 0}
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "status").write_text("Name:\tw\nCapPrm:\tzz\n")
    assert caps.sets(8, tmp_path) is None and caps.sets(9, tmp_path) is None
    assert "CapBnd" in (caps.sets("self") or {})  # the real file has every set


def test_a_capability_in_any_set_beyond_the_agents_is_named_per_process(tmp_path: Path) -> None:
    _status(tmp_path, "self", prm=DEFAULT | (1 << 21), bnd=DEFAULT | (1 << 21))
    _status(tmp_path, "100", prm=DEFAULT, eff=DEFAULT, bnd=DEFAULT)
    _status(tmp_path, "101", prm=DEFAULT, bnd=DEFAULT | SYS_TIME)  # only its bounding set
    _status(tmp_path, "102", amb=SYS_TIME, bnd=DEFAULT)  # only its ambient set
    assert capabilities_beyond(_worker(tmp_path, 100, 101, 102), tmp_path) == {"10001": ["SYS_TIME"],
                                                                               "10002": ["SYS_TIME"]}
    assert capabilities_beyond(_worker(tmp_path, 100), tmp_path) == {}


def test_the_agents_bounding_set_limits_what_its_permitted_set_says(tmp_path: Path) -> None:
    _status(tmp_path, "self", prm=DEFAULT | SYS_TIME, bnd=DEFAULT)
    _status(tmp_path, "100", bnd=DEFAULT | SYS_TIME)
    assert capabilities_beyond(_worker(tmp_path, 100), tmp_path) == {"10000": ["SYS_TIME"]}


def test_unreadable_sets_count_as_everything_and_a_gone_process_as_nothing(tmp_path: Path) -> None:
    _status(tmp_path, "self", prm=DEFAULT, bnd=DEFAULT)
    (tmp_path / "100").mkdir()
    (tmp_path / "100" / "status").write_text("Name:\tw\nState:\tS\nPPid:\t1\nNSpid:\t100\t10000\nCapPrm:\tnope\n")
    beyond = capabilities_beyond(_worker(tmp_path, 100, 101), tmp_path)  # 101 has no /proc entry: gone
    assert list(beyond) == ["10000"] and "SYS_ADMIN" in beyond["10000"] and "KILL" not in beyond["10000"]


def test_the_snapshot_preflight_refuses_it_for_good_before_any_change(tmp_path: Path) -> None:
    _status(tmp_path, "self", prm=DEFAULT, bnd=DEFAULT)
    _status(tmp_path, "100", prm=DEFAULT, bnd=DEFAULT | SYS_TIME)
    w = dataclasses.replace(_worker(tmp_path, 100), info={"pid_reserved": True, "seccomp": "on"})
    with pytest.raises(StepFailure) as e:
        CS.snapshot_preflight(cast(Any, SimpleNamespace(proc=tmp_path)), w)
    assert e.value.reason == Reason.CAPABILITIES_BEYOND_AGENT and e.value.changed is False
    assert e.value.reason in PERMANENT_REFUSALS, "it lasts as long as the pod's spec: not waited out"
    assert "{'10000': ['SYS_TIME']}" in e.value.message
    _status(tmp_path, "100", prm=DEFAULT, bnd=DEFAULT)
    CS.snapshot_preflight(cast(Any, SimpleNamespace(proc=tmp_path)), w)  # within the agent's: no refusal
