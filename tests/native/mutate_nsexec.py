"""Mutation check of dynsnap-nsexec (docs/NATIVE.md, "dynsnap-nsexec"): each guard of
native/nsexec/dynsnap-nsexec.c broken by an exact replacement, built with `make -C native nsexec` into a
private build directory, then the tests of tests/native/test_nsexec.py that must go red.
Not collected by pytest (no test_ prefix). From the repository root, as root (the tests make namespaces),
with the dev venv's python:

    V=$(ls -td ~/.cache/dynsnap/venv-dev-*/ | head -1)
    $V/bin/python tests/native/mutate_nsexec.py [--list] [--all-failures] [INDEX|ID ...]

No mutant takes the launcher's private mount namespace away: the program's fresh /proc would then be
mounted over the node's. tests/mutation/runner.py says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation.runner import Suite, main, mutation

NSEXEC = "native/nsexec/dynsnap-nsexec.c"
N = "tests/native/test_nsexec.py::"
LOADS_NOTHING = N + "test_a_program_started_by_nsexec_loads_nothing_of_the_pods"
OWN_USERNS = N + "test_a_pid1_in_a_user_namespace_of_its_own_is_refused_before_anything_runs"
FOREIGN_MNT = N + "test_a_namespace_owned_by_another_user_namespace_is_refused[mnt]"
FOREIGN_NET = N + "test_a_namespace_owned_by_another_user_namespace_is_refused[net]"
NOT_CHECKED = N + "test_a_target_that_is_not_the_process_checked_is_never_entered"
DIES_WITH = N + "test_the_program_dies_with_the_launcher"
HANDED = N + "test_the_checked_mount_namespace_is_handed_over_as_a_descriptor"
NEVER_MNT = N + "test_the_mount_and_user_namespaces_are_never_entered"
JOINED = N + "test_joined_the_program_runs_in_the_targets_cgroups_and_outlives_the_launcher"

MUTATIONS = (
    mutation(
        "enters-the-mount-namespace", "the target's mount namespace entered too (as nsenter -m did)", NSEXEC,
        "\t/* 4. A mount namespace of its own, nothing propagated in or out. */\n",
        "\tif (setns(mnt_fd, CLONE_NEWNS))\n\t\tdie(EXIT_FAILED, \"setns(mnt)\");\n"
        "\t/* 4. A mount namespace of its own, nothing propagated in or out. */\n",
        tests=[LOADS_NOTHING]),
    mutation(
        "no-fresh-proc", "the program keeps the caller's /proc (the node's pids, not the target's)", NSEXEC,
        "\t\tif (private_mounts && want[0]) {\n",
        "\t\tif (0 && private_mounts && want[0]) {\n",
        tests=[LOADS_NOTHING]),
    mutation(
        "user-namespace-unchecked", "a target in a user namespace of its own is entered", NSEXEC,
        "\tif (target_user != node_user)\n",
        "\tif (0 && target_user != node_user)\n",
        tests=[OWN_USERNS]),
    mutation(
        "mount-namespace-owner-unchecked", "a mount namespace owned by another user namespace is taken", NSEXEC,
        "\tino_t owner = owner_of(mnt_fd, \"mnt\");\n\tif (owner != node_user)\n",
        "\tino_t owner = owner_of(mnt_fd, \"mnt\");\n\tif (0 && owner != node_user)\n",
        tests=[FOREIGN_MNT]),
    mutation(
        "entered-namespace-owner-unchecked", "a namespace entered that another user namespace owns", NSEXEC,
        "\t\towner = owner_of(fds[k], ENTERABLE[k].name);\n\t\tif (owner != node_user)\n",
        "\t\towner = owner_of(fds[k], ENTERABLE[k].name);\n\t\tif (0 && owner != node_user)\n",
        tests=[FOREIGN_NET]),
    mutation(
        "start-time-unchecked", "a process other than the one the agent checked is entered", NSEXEC,
        "\tif (want_start >= 0 && started != want_start)\n",
        "\tif (0 && want_start >= 0 && started != want_start)\n",
        tests=[NOT_CHECKED]),
    mutation(
        "no-death-signal", "the program outlives a killed launcher", NSEXEC,
        "\t\tif (!outlive && prctl(PR_SET_PDEATHSIG, SIGKILL))\n",
        "\t\tif (0 && !outlive && prctl(PR_SET_PDEATHSIG, SIGKILL))\n",
        tests=[DIES_WITH]),
    mutation(
        "mount-namespace-not-handed-over", "the checked mount namespace stays close-on-exec", NSEXEC,
        "\t\tif (dup2(mnt_fd, mntns_out) < 0 || fcntl(mntns_out, F_SETFD, 0) < 0)\n",
        "\t\tif (dup2(mnt_fd, mntns_out) < 0 || fcntl(mntns_out, F_SETFD, FD_CLOEXEC) < 0)\n",
        tests=[HANDED]),
    mutation(
        "mnt-enterable", "--ns mnt accepted", NSEXEC,
        "\t{\"cgroup\", CLONE_NEWCGROUP, \"cgroup\"},\n};",
        "\t{\"cgroup\", CLONE_NEWCGROUP, \"cgroup\"},\n\t{\"mnt\", CLONE_NEWNS, \"mnt\"},\n};",
        tests=[NEVER_MNT]),
    mutation(
        "cgroups-not-joined", "--join-cgroups leaves the program in the caller's cgroups", NSEXEC,
        "\t\tif (join)\n\t\t\tjoin_cgroups();\n",
        "\t\tif (0 && join)\n\t\t\tjoin_cgroups();\n",
        tests=[JOINED]),
    mutation(
        "outlive-ignored", "--outlive: the program still dies with the launcher", NSEXEC,
        "\t\tif (!outlive && prctl(PR_SET_PDEATHSIG, SIGKILL))\n",
        "\t\tif (prctl(PR_SET_PDEATHSIG, SIGKILL))\n",
        tests=[JOINED]),
)

SUITE = Suite(
    name="dynsnap-nsexec",
    doc="docs/NATIVE.md",
    mutations=MUTATIONS,
    build=("make", "-s", "-C", "native", "BUILD={build}", "nsexec"),
    rebuild=("make", "-s", "-C", "native", "BUILD={root}/native/build", "nsexec"),
    env={"DYNSNAP_NATIVE_BIN": "{build}"},  # the tests run the private build's binary
    pytest_args=("--timeout", "120"),
    timeout=600,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
