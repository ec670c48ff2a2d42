"""The keys of a worker process's environment the agent uses, validated. A worker's environment
(``/proc/<pid>/environ``) is written by whoever controls the worker; the agent reads only these keys,
and each becomes a value only when it is what it claims to be. Pure types (bottom layer).

- ``NCCL_P2P_DISABLE``, ``NCCL_SHM_DISABLE``, ``NCCL_CUMEM_ENABLE``: the switches of the multi-GPU
  preflight (they are compared with "0"/"1" and shown in its message), a short word each;
- ``KUBERNETES_SERVICE_HOST`` and ``_PORT``: an IP address and a port 1-65535 (they become arguments
  of ``ss -K`` in the pod's network namespace after a long sleep);
- ``KUBECONFIG``: its first path, absolute and bounded (read through the container's root).

A key that is present but not valid is left out and named in :attr:`WorkerEnv.invalid`, never passed
on; the caller decides what that means for it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Annotated, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

# What one exec may pass in argv + environment under the default 8 MiB stack limit (a quarter of it,
# ARG_MAX): an environment larger than this was not given to the process at exec, and is not read.
ENVIRON_BOUND: Final = 2 * 1024 * 1024

NCCL_SWITCHES: Final = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_CUMEM_ENABLE")

_Switch = Annotated[str, StringConstraints(max_length=16, pattern=r"^[0-9A-Za-z_.-]*$")]
_Port = Annotated[int, Field(ge=1, le=65535)]
_Path = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")]

T = TypeVar("T")

_SWITCH: Final = TypeAdapter(_Switch)
_PORT: Final = TypeAdapter(_Port)
_PATH: Final = TypeAdapter(_Path)


class WorkerEnv(BaseModel):
    model_config = ConfigDict(frozen=True)

    nccl: dict[str, str] = {}  # the NCCL_SWITCHES that are set, by name
    service_host: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    service_port: int | None = None
    kubeconfig: str | None = None  # the first path of KUBECONFIG
    invalid: tuple[str, ...] = ()  # keys present and refused

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> WorkerEnv:
        """The keys of ``env`` the agent uses; every other key is ignored."""
        invalid: list[str] = []
        nccl = {}
        for key in NCCL_SWITCHES:
            if key in env:
                value = _valid(_SWITCH, env[key])
                if value is None:
                    invalid.append(key)
                else:
                    nccl[key] = value
        host = None
        if "KUBERNETES_SERVICE_HOST" in env:
            try:
                host = ipaddress.ip_address(env["KUBERNETES_SERVICE_HOST"].strip("[]"))
            except ValueError:
                invalid.append("KUBERNETES_SERVICE_HOST")
        port = None
        if "KUBERNETES_SERVICE_PORT" in env:
            raw = env["KUBERNETES_SERVICE_PORT"]
            port = _valid(_PORT, int(raw)) if raw.isascii() and raw.isdigit() and len(raw) <= 5 else None
            if port is None:
                invalid.append("KUBERNETES_SERVICE_PORT")
        kubeconfig = None
        if env.get("KUBECONFIG"):
            kubeconfig = _valid(_PATH, env["KUBECONFIG"].split(":", 1)[0])
            if kubeconfig is None:
                invalid.append("KUBECONFIG")
        return cls(nccl=nccl, service_host=host, service_port=port, kubeconfig=kubeconfig, invalid=tuple(invalid))


def _valid(adapter: TypeAdapter[T], value: object) -> T | None:
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return None
